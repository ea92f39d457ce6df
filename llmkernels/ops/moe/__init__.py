"""The Mixture-of-Experts family: the router (``router``: scores, top-k, auxiliary losses)."""
from .router import RouterOptions, moe_load_balancing_loss, moe_route, moe_router_z_loss

__all__ = ["RouterOptions", "moe_load_balancing_loss", "moe_route", "moe_router_z_loss"]
