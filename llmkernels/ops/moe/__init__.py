"""The Mixture-of-Experts family, a package: the router (``router``: scores, top-k, auxiliary
losses), the routing metadata (``routing``: slots sorted by expert, row tiles), the kernels
(``kernels``: grouped GEMMs with the token gather on load, the gated activation in the epilogue
and the scatter on store; weight gradients; the combine), their launch configurations
(``configs``), the launchers (``experts``), the registration (``register``) and the public
call (``api``)."""
from .api import ExpertLora, moe_experts
from .configs import GemmTiles, MoeConfig
from .router import RouterOptions, moe_load_balancing_loss, moe_route, moe_router_z_loss

__all__ = ["ExpertLora", "GemmTiles", "MoeConfig", "RouterOptions", "moe_experts", "moe_load_balancing_loss",
           "moe_route", "moe_router_z_loss"]
