"""bf16/f16 elementwise ops emitted in their own dtype (``narrow_elementwise``): which calls qualify, and that
results stay as close to float64 as eager PyTorch's, forward and backward, with the option on and off."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tests.support import assert_compiles_like_eager, compile_fn, compiles_per_setting

_SHORT = {torch.bfloat16: "bf16", torch.float16: "f16"}
NARROW = [torch.bfloat16, torch.float16]


def _program(fn, *args, narrow_elementwise=True):
    from tpucompile.lowering import lower_graph

    return lower_graph(make_fx(fn)(*args), narrow_elementwise=narrow_elementwise).text(debug_info=False)


def _main_body(text: str) -> str:
    return text.split("func.func public @main", 1)[1]


def _exact_calls(a, b):
    return (
        (a + b) * a - b,
        torch.maximum(a, b).neg().abs(),
        torch.clamp(a, -1.0, 2.0),
        a.pow(2) - 0.5 * b,  # 0.5 is exact in both dtypes
        a < b,
    )


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_exact_calls_are_emitted_in_their_own_dtype(dtype):
    a, b = torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
    narrow = _main_body(_program(_exact_calls, a, b))
    assert "f32" not in narrow and "stablehlo.convert" not in narrow, narrow
    assert f"tensor<4x8x{_SHORT[dtype]}>" in narrow
    widened = _main_body(_program(_exact_calls, a, b, narrow_elementwise=False))
    assert "tensor<4x8xf32>" in widened and "stablehlo.convert" in widened


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a * 0.1,  # 0.1 rounds in bf16/f16: eager multiplies by the f32 value
        lambda a, b: torch.add(a, b, alpha=2),  # a + 2b rounds once in f32, twice narrow
        lambda a, b: a / b,  # division is left to f32: TPUs do not divide correctly rounded
        lambda a, b: a.exp(),
        lambda a, b: a + b.float(),  # the result is f32
    ],
    ids=["inexact-scalar", "alpha", "divide", "exp", "mixed"],
)
def test_calls_that_would_round_differently_stay_in_f32(fn):
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert "tensor<4x8xf32>" in _main_body(_program(fn, a, b))
    assert_compiles_like_eager(fn, a, b, atol=0, rtol=0)


def test_powers_other_than_squares_stay_in_f32():
    a = torch.rand(4, 8, dtype=torch.bfloat16) + 0.5
    assert "tensor<4x8xf32>" in _main_body(_program(lambda a: a.pow(3), a))
    assert_compiles_like_eager(lambda a: a.pow(3), a)


def _decoder_block(x, norm, w_gate, w_up, w_down, w_out):
    """The bf16 paths of a decoder layer: an RMSNorm computed op by op in bf16 (as a model cast with
    ``.to(torch.bfloat16)`` does), a SiLU-gated MLP whose products are widened by SiLU's f32 opmath, residual
    adds, and a clamp and a comparison in the same dtype."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    h = x + (F.silu(h @ w_gate) * (h @ w_up)) @ w_down
    return h + torch.where(h > 0, h, -h).clamp(max=4.0) @ w_out


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_elementwise_switch_differential(dtype):
    """On and off, forward and every gradient, each as close to float64 as eager in ``dtype`` is (twice its
    error at most, with a floor of one rounding step). Not bitwise: given narrow ops, XLA may skip the
    rounding between two of them (its excess precision: the CPU compiler widens ``x * x`` feeding the mean
    without rounding the product), where eager rounds after each op; the off form keeps every rounding."""
    torch.manual_seed(0)
    width, hidden = 64, 96
    inputs = [torch.randn(2, 16, width), torch.rand(width) + 0.5, torch.randn(width, hidden) / 8,
              torch.randn(width, hidden) / 8, torch.randn(hidden, width) / 8, torch.randn(width, width) / 8]

    def run(fn, as_dtype):
        leaves = [t.to(as_dtype).requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.double().square().sum().backward()
        return [out.detach().double(), *[t.grad.double() for t in leaves]]

    exact, eager = run(_decoder_block, torch.float64), run(_decoder_block, dtype)
    step = torch.finfo(dtype).eps
    names = ("output", "x", "norm", "gate", "up", "down", "out")
    for narrow in (True, False):
        compiled = run(compile_fn(_decoder_block, narrow_elementwise=narrow), dtype)
        for name, got, want, own in zip(names, compiled, exact, eager, strict=True):
            tolerance = max(2 * (own - want).abs().max().item(), step * want.abs().max().item())
            error = (got - want).abs().max().item()
            assert error <= tolerance, (f"narrow_elementwise={narrow}: {name} is {error:.3g} from float64, eager "
                                        f"{dtype} {(own - want).abs().max().item():.3g}")


def test_narrow_elementwise_switch_is_in_the_cache_key(tmp_path):
    """A program stored with one setting is never served for the other, and each is found again."""
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    counts = compiles_per_setting(torch.add, (a, b), "narrow_elementwise", (True, False, True, False), str(tmp_path))
    assert counts == [1, 1, 0, 0]
