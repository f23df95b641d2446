"""Matrix products against eager PyTorch: every matmul entry point, broadcasting, dtypes and gradients."""

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager, compile_fn, compiles_per_setting


# Low-precision products accumulate in f32 and round once, as eager's CPU kernels do: default tolerances.
@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _products(a, b, c, v, bias):
    return (
        a @ b,
        torch.mm(a, b),
        torch.addmm(bias, a, b),
        torch.addmm(bias[0], a, b, beta=0.5, alpha=2.0),
        torch.addmm(bias, a, b, beta=0.0, alpha=-1.5),
        torch.mv(a, v),
        a @ v,
        v @ b,
        v @ v,
        torch.dot(v, v * 2),
        torch.bmm(c, b.expand(2, 16, 5)),
        torch.baddbmm(c[:, :, :5], c, b.expand(2, 16, 5), beta=0.25, alpha=3.0),
        torch.baddbmm(bias[:3], c, b.expand(2, 16, 5)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mm_addmm_bmm(dtype):
    args = [
        torch.randn(3, 16),
        torch.randn(16, 5),
        torch.randn(2, 3, 16),
        torch.randn(16),
        torch.randn(3, 5),
    ]
    # Gradients in f32 only: in bf16/f16 each input's gradient here is a sum of a dozen rounded products
    # that cancel, and eager adds them in another order; test_low_precision_gradients covers the backward.
    assert_compiles_like_eager(_products, *(t.to(dtype) for t in args), grad=dtype is torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_gradients(dtype):
    def fn(x, w, b, c):
        return F.linear(x, w, b), torch.bmm(c, c.transpose(1, 2))

    args = [torch.randn(4, 3, 16), torch.randn(8, 16), torch.randn(8), torch.randn(2, 3, 16)]
    assert_compiles_like_eager(fn, *(t.to(dtype) for t in args), grad=True)


def test_addmm_beta_zero_ignores_nan_bias():
    def fn(bias, a, b):
        batched = torch.baddbmm(bias.expand(2, 3, 5), a.expand(2, 3, 4), b.expand(2, 4, 5), beta=0)
        return torch.addmm(bias, a, b, beta=0), batched

    bias = torch.full((3, 5), float("nan"))
    assert_compiles_like_eager(fn, bias, torch.randn(3, 4), torch.randn(4, 5))


def test_matmul_broadcasting():
    def fn(v, m, b3, b4, w):
        return (
            v @ v,  # 1-D @ 1-D: a scalar
            v @ b3,  # 1-D @ 3-D: prepended 1 removed
            b3 @ w[:, 0],  # 3-D @ 1-D
            m @ b3,  # 2-D @ 3-D: the matrix broadcasts over the batch
            b3 @ w,  # 3-D @ 2-D: folded into one mm
            b4 @ b3.transpose(-1, -2)[:, :, :2].unsqueeze(1),  # batch [3, 2] against [3, 1]
            torch.matmul(b4, b4.transpose(-1, -2)),
            b4[:2, :1] @ (w * b3[:, :1, :1]).unsqueeze(0),  # batch [2, 1] against [1, 3]
        )

    assert_compiles_like_eager(
        fn,
        torch.randn(4),
        torch.randn(6, 4),
        torch.randn(3, 4, 5),
        torch.randn(3, 2, 6, 5),
        torch.randn(5, 7),
        grad=True,
    )


def test_linear_and_einsum():
    def fn(x, w, b, q, k):
        return (
            F.linear(x, w, b),
            F.linear(x, w),
            F.linear(x[0, 0], w, b),
            torch.einsum("bij,bjk->bik", x, w.t().expand(2, 8, 6)),
            torch.einsum("i,j->ij", b, x[0, 0]),
            torch.einsum("bhqd,bhkd->bhqk", q, k),
            torch.einsum("bhqk,bhkd->bqhd", q @ k.transpose(-1, -2), k),
            torch.einsum("ii->i", w[:, :6]),
            torch.einsum("bij->bj", x),
        )

    assert_compiles_like_eager(
        fn,
        torch.randn(2, 3, 8),
        torch.randn(6, 8),
        torch.randn(6),
        torch.randn(2, 2, 3, 4),
        torch.randn(2, 2, 5, 4),
        grad=True,
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_integer_matmul(dtype):
    def fn(a, b, c, bias):
        return a @ b, torch.bmm(c, c.transpose(1, 2)), torch.addmm(bias, a, b, beta=2, alpha=3), c @ b[:5, :2]

    ints = dict(dtype=dtype)
    assert_compiles_like_eager(
        fn,
        torch.randint(-9, 9, (3, 5), **ints),
        torch.randint(-9, 9, (5, 4), **ints),
        torch.randint(-9, 9, (2, 4, 5), **ints),
        torch.randint(-9, 9, (4,), **ints),
    )


def test_matmul_of_mixed_results_trains_like_eager():
    """A two-layer MLP step: products feeding products, with every gradient checked."""

    def fn(x, w1, b1, w2):
        hidden = torch.tanh(F.linear(x, w1, b1))
        return (hidden @ w2).sum(-1), hidden.transpose(-1, -2) @ hidden

    assert_compiles_like_eager(
        fn, torch.randn(4, 3, 8), torch.randn(16, 8), torch.randn(16), torch.randn(16, 2), grad=True,
        atol=5e-5, rtol=1e-4,  # gradients through two products and tanh: f32 sums in another order
    )


def _product_lines(fn, *args, narrow_products=True):
    """The StableHLO ``dot_general`` lines of ``fn``'s ATen graph (``make_fx``: mm/bmm reach the rules as
    they are)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpucompile.lowering import lower_graph

    program = lower_graph(make_fx(fn)(*args), narrow_products=narrow_products)
    return [line for line in program.text(debug_info=False).splitlines() if "stablehlo.dot_general" in line]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_products_are_written_narrow_and_rounded_once(dtype):
    short = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    a, b, c = torch.randn(8, 4096), torch.randn(4096, 16), torch.randn(3, 8, 4096)

    def products(a, b, c):
        return a @ b, torch.bmm(c, b.expand(3, 4096, 16))

    args = [t.to(dtype) for t in (a, b, c)]
    lines = _product_lines(products, *args)
    assert len(lines) == 2 and all(line.endswith(f"{short}>") for line in lines), lines
    assert all(line.endswith("f32>") for line in _product_lines(products, *args, narrow_products=False))
    # accumulated in f32: a sum of 4096 ones is exact (a narrow accumulator stops at 256 or 2048)
    ones = [torch.ones(8, 4096, dtype=dtype), torch.ones(4096, 16, dtype=dtype), torch.ones(3, 8, 4096, dtype=dtype)]
    for total in compile_fn(products, narrow_products=True)(*ones):
        assert total.dtype == dtype and bool((total == 4096).all()), total
    assert_compiles_like_eager(products, *args, narrow_products=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_widened_product_is_narrow_and_a_product_with_a_bias_rounds_once(dtype):
    """A narrow product that a user converts to f32 (through views) is still written narrow (the same
    rounding: the widening reads the rounded product); a product with a bias keeps its f32 product and adds
    the bias before the one rounding, as PyTorch does."""
    a, b, bias = (torch.randn(8, 64).to(dtype), torch.randn(64, 16).to(dtype), torch.randn(16).to(dtype))
    short = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]

    def widened(a, b):
        return (a @ b).t().reshape(-1).float()

    def with_bias(bias, a, b):
        return torch.addmm(bias, a, b)

    assert all(line.endswith(f"{short}>") for line in _product_lines(widened, a, b))
    assert all(line.endswith("f32>") for line in _product_lines(with_bias, bias, a, b))
    assert_compiles_like_eager(widened, a, b, narrow_products=True)
    assert_compiles_like_eager(with_bias, bias, a, b, narrow_products=True)


def test_auto_writes_products_narrow_except_in_a_split_backward():
    """At "auto" (the default) the forward of a training step writes its bf16 products narrow and its
    backward writes f32 products and converts; a whole program traced with ``torch.func`` (one inference
    graph, its gradients inside) is narrow throughout; true and false force one form."""
    from tpucompile import driver

    weight = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(16, 64, dtype=torch.bfloat16)

    def loss(w, x):
        return (x @ w.t()).float().square().sum()

    def programs(setting, fn, *args, backward=False):
        texts = {}
        remove = driver.add_observer(lambda event: texts.__setitem__(event.name.rsplit("(", 1)[-1].rstrip(")"),
                                                                     event.program.text(debug_info=False)))
        try:
            torch._dynamo.reset()
            options = {"cache_mode": "off"} if setting is None else {"cache_mode": "off", "narrow_products": setting}
            out = torch.compile(fn, backend="tpucompile", options=options)(*args)
            if backward:
                out.backward()
        finally:
            remove()
        return {role: {line.rsplit(" ", 1)[-1] for line in text.splitlines() if "stablehlo.dot_general" in line}
                for role, text in texts.items()}

    split = programs(None, loss, weight, x, backward=True)
    assert split["forward"] == {"tensor<16x32xbf16>"}, split
    assert split["backward"] and all(t.endswith("xf32>") for t in split["backward"]), split
    whole = programs(None, torch.func.grad(loss), weight.detach(), x)
    assert whole["inference"] and all(t.endswith("xbf16>") for t in whole["inference"]), whole
    for setting, suffix in ((True, "xbf16>"), (False, "xf32>")):
        forced = programs(setting, loss, weight, x, backward=True)
        assert all(t.endswith(suffix) for role in ("forward", "backward") for t in forced[role]), (setting, forced)
    assert_compiles_like_eager(loss, weight.detach(), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_narrow_products_switch_differential(dtype):
    """``narrow_products`` on and off against float64 eager, forward and every gradient, on a block with
    products in every position (projections, scores widened for a softmax, their backward): each is as close
    to float64 as eager in ``dtype`` is (twice its error at most, with a floor of one rounding step).

    Not bitwise against eager: the off form rounds each product where eager does; the on form is the same
    products written narrow, and XLA moves the roundings of the backward's elementwise ops differently
    around them, so a few gradient elements land one or two rounding steps from eager's (as often nearer
    float64 as farther)."""

    def block(x, w1, w2):
        h = torch.tanh(x @ w1)
        scores = torch.softmax(torch.bmm(h, h.transpose(1, 2)).float() / 8, dim=-1).to(h.dtype)
        return torch.bmm(scores, h) @ w2

    def run(fn, as_dtype):
        leaves = [t.to(as_dtype).requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.double().square().sum().backward()
        return [out.detach().double(), *[t.grad.double() for t in leaves]]

    step = torch.finfo(dtype).eps
    for seed in range(2):
        torch.manual_seed(seed)
        inputs = [torch.randn(2, 32, 64), torch.randn(64, 64) / 8, torch.randn(64, 16) / 8]
        exact, eager = run(block, torch.float64), run(block, dtype)
        for narrow in (True, False):
            compiled = run(compile_fn(block, narrow_products=narrow), dtype)
            for name, got, want, own in zip(("output", "x", "w1", "w2"), compiled, exact, eager, strict=True):
                tolerance = max(2 * (own - want).abs().max().item(), step * want.abs().max().item())
                error = (got - want).abs().max().item()
                assert error <= tolerance, (f"narrow_products={narrow}, seed {seed}: {name} is {error:.3g} from "
                                            f"float64, eager {dtype} {(own - want).abs().max().item():.3g}")


def test_narrow_products_switch_is_in_the_cache_key(tmp_path):
    """A program stored with one setting is never served for the other (the key holds the option), and each
    is found again under its own."""
    a, b = torch.randn(8, 64).bfloat16(), torch.randn(64, 16).bfloat16()
    counts = compiles_per_setting(torch.mm, (a, b), "narrow_products", (True, False, True, False), str(tmp_path))
    assert counts == [1, 1, 0, 0]
