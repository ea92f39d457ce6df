"""The registration of an op (``ops/_register.Op``) on a plain-PyTorch launcher, eager and under
torch.compile (``aot_eager``: no C++ compiler): what a call hands back, the default ``setup``, an
op without autograd, and the schema read from the launcher's annotations."""
from typing import NamedTuple, Optional

import pytest
import torch

from llmkernels.ops._register import Op, Signature


class Scale(NamedTuple):
    factor: float


def _cube(x: torch.Tensor, options: Scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(factor x^3, 3 x^2): the caller gets the first, the backward reads the second."""
    return options.factor * x ** 3, 3 * x * x


def _cube_backward(ctx, bwd, dy, *_):
    x, slope = ctx.saved_tensors  # what the default setup saved: the tensors, then the outputs not returned
    return (ctx.options.factor * slope * dy,)


CUBE = Op("test_register_cube", forward=_cube, backward=_cube_backward, grad_inputs=(0,), returns=1,
          fake=lambda x, options: (torch.empty_like(x), torch.empty_like(x)))


def _norm_of(x: torch.Tensor, weight: Optional[torch.Tensor], options: Scale) -> torch.Tensor:
    return options.factor * x.norm() if weight is None else options.factor * (weight * x).norm()


NORM_OF = Op("test_register_norm_of", forward=_norm_of, fake=lambda x, weight, options: x.new_empty(()))


@pytest.mark.parametrize("compiled", [False, True])
def test_returns_one_hands_back_the_output_itself(compiled):
    """``returns=1``: the output, not a 1-tuple, on every path; the default setup saves the
    tensors and the outputs the caller does not get; the gradient follows the backward."""
    torch.compiler.reset()
    call = torch.compile(CUBE, fullgraph=True, backend="aot_eager") if compiled else CUBE
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        y = call(x, Scale(3.0))
    assert isinstance(y, torch.Tensor) and torch.allclose(y, 3.0 * x.detach() ** 3)
    y = call(x, Scale(3.0))
    assert isinstance(y, torch.Tensor)
    g = torch.randn(5, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(dx, 9.0 * x.detach() ** 2 * g)


@pytest.mark.parametrize("compiled", [False, True])
def test_op_without_autograd(compiled):
    """An op described without ``backward`` is a custom op and a plain call of its launcher (no
    autograd Function); an Optional tensor may be None."""
    torch.compiler.reset()
    call = torch.compile(NORM_OF, fullgraph=True, backend="aot_eager") if compiled else NORM_OF
    x, w = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    assert NORM_OF.function is None
    assert torch.allclose(call(x, w, Scale(2.0)), 2.0 * (w * x).norm())
    assert torch.allclose(call(x, None, Scale(2.0)), 2.0 * x.norm())


def test_schema_is_read_from_the_annotations():
    """Tensors (``Optional``: ``Tensor?``), the record's fields flat after them, the outputs."""
    assert Signature.of(_norm_of).schema == "(Tensor x, Tensor? weight, float factor) -> Tensor"
    assert Signature.of(_cube).schema == "(Tensor x, float factor) -> (Tensor, Tensor)"
