"""Each Hugging Face family's declared norm rounding (``hf/families.py``) is its transformers
module's own: bf16 weights and input, the reference of the declared casting equal bit for bit
(the other castings differ, so a wrong declaration fails)."""
import importlib
import inspect

import pytest
import torch

from llmkernels import reference
from llmkernels.hf.families import FAMILIES

pytest.importorskip("transformers")
NORMS = [(model_type, name, casting) for model_type, family in FAMILIES.items()
         for name, casting in family.norms.items()]


@pytest.mark.parametrize("model_type,name,casting", NORMS, ids=[f"{t}-{n}" for t, n, _ in NORMS])
def test_declared_norm_rounding_is_transformers(model_type, name, casting):
    module = FAMILIES[model_type].module
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    takes_size = list(inspect.signature(cls.__init__).parameters)[1:2] in (["hidden_size"], ["dim"])
    norm = cls(64) if takes_size else cls()
    if getattr(norm, "weight", None) is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64) * 0.1 + (0.0 if casting == "gemma" else 1.0))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(64, 64).to(torch.bfloat16)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    weight = None if getattr(norm, "weight", None) is None else norm.weight.detach()
    equal = {c: torch.equal(norm(x), reference.rms_norm(x, weight, eps=eps, casting=c))
             for c in reference.NORM_CASTINGS}
    assert equal[casting], f"{name}: transformers' output is not casting={casting!r}'s ({equal})"
    assert weight is None or sum(equal.values()) == 1, equal
