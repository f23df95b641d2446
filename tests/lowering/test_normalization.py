"""Softmax and normalisation layers against eager PyTorch, with gradients, and the running statistics that
BatchNorm writes back (input mutations AOTAutograd returns from the functional graph)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_close_tree, assert_compiles_like_eager, compile_fn
from tpucompile import driver

INF = float("inf")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Eager's CPU softmax rounds exp() to bf16/f16 before normalising; tpucompile rounds once at the end, so
# results can differ by an ulp (f16's ulp is 2**-10 relative, more than the default rtol).
LOW = {torch.bfloat16: {}, torch.float16: dict(atol=1e-3, rtol=2e-3)}


def _softmaxes(x):
    return (
        x.softmax(1),
        x.softmax(-1),
        x.log_softmax(-1),
        x.log_softmax(0),
        x.softmax(-1, dtype=torch.float32),
        F.log_softmax(x, 1, dtype=torch.float32),
        x[0, 0, 0].softmax(0),  # 0-d
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_softmax_log_softmax(dtype):
    tol = LOW.get(dtype, {})
    x = torch.randn(4, 6, 8) * 3
    # Low precision: forward of everything, gradients one op at a time (summed gradients of several ops
    # cancel in bf16/f16, and eager sums them in another order).
    assert_compiles_like_eager(_softmaxes, x.to(dtype), grad=dtype is torch.float32, **tol)
    if dtype is not torch.float32:
        assert_compiles_like_eager(lambda x: x.softmax(1), x.to(dtype), grad=True, **tol)
        # log_softmax's gradient is grad - exp(out) * sum(grad): an ulp of difference in the saved bf16/f16
        # output moves it by up to sum(grad) * max(p * |log p|) * ulp = 8 * 0.37 * ulp here.
        ulp = 2**-8 if dtype is torch.bfloat16 else 2**-11
        assert_compiles_like_eager(
            lambda x: x.log_softmax(-1), x.to(dtype), grad=True, atol=8 * ulp, rtol=tol.get("rtol", 1.6e-2)
        )
    x[0, 1, :3] = -INF  # some -inf entries: zero probability
    x[1, :, 2] = -INF  # a whole -inf column: NaN for softmax over dim 1, as in eager
    assert_compiles_like_eager(_softmaxes, x.to(dtype), **tol)


def test_softmax_special_values():
    def fn(x):
        return x.softmax(-1), x.log_softmax(-1), x[0, 0].softmax(0), x[0, 0].log_softmax(0), x[2, 1].softmax(0)

    x = torch.randn(4, 5)
    x[0, 0] = float("nan")  # a NaN row, and a 0-d NaN
    x[1, 3] = INF  # +inf: inf - inf = NaN, as in eager
    x[2, :] = -INF
    x[3, 1:] = -INF  # one finite entry: probability 1
    assert_compiles_like_eager(fn, x)


def test_softmax_float64_dtype_argument():
    def fn(x):
        return x.softmax(0, dtype=torch.float64), x.double().log_softmax(1)

    assert_compiles_like_eager(fn, torch.randn(5, 7), grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm(dtype):
    def fn(x, w, b):
        return (
            F.layer_norm(x, (6, 8), w, b),
            F.layer_norm(x, (8,)),
            F.layer_norm(x, (8,), w[0]),
            F.layer_norm(x, (8,), None, b[0], eps=1e-2),
            F.layer_norm(x, (4, 6, 8)),
        )

    args = [a.to(dtype) for a in (torch.randn(4, 6, 8) * 2 + 1, torch.randn(6, 8), torch.randn(6, 8))]
    # bf16: gradients of one layer norm only. Summed over the five uses above, the parameters' bf16
    # gradients cancel, and eager's (rounded after every op) ends up further from the f64 result than ours.
    assert_compiles_like_eager(fn, *args, grad=dtype is torch.float32)
    if dtype is not torch.float32:
        assert_compiles_like_eager(lambda x, w, b: F.layer_norm(x, (6, 8), w, b), *args, grad=True)


def test_layer_norm_module_with_mixed_precision():
    norm = torch.nn.LayerNorm(8)

    def fn(x):
        return norm(x.float()).to(x.dtype)

    assert_compiles_like_eager(fn, torch.randn(3, 8).to(torch.bfloat16), grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm(dtype):
    def fn(x, w):
        hand = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[0]
        return F.rms_norm(x, (8,), w[0], eps=1e-5), F.rms_norm(x, (6, 8), w), F.rms_norm(x, (8,)), hand

    # The hand-written form is a chain of bf16 ops: eager rounds after each, XLA keeps f32 inside the fused
    # chain (closer to the f64 result), so a few bf16 ulps apart.
    tol = dict(atol=5e-2, rtol=2e-2) if dtype is torch.bfloat16 else {}
    assert_compiles_like_eager(fn, torch.randn(4, 6, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype), grad=True,
                               **tol)


# Module tests compare f32 sums over batch and spatial dims with cancellation (a parameter's gradient is a
# sum of products with the normalised input, whose mean is zero) taken in another order.
MODULE_F32 = dict(atol=5e-5, rtol=1e-4)


def _close(actual, expected):
    tol = MODULE_F32 if expected.dtype is torch.float32 else {}
    assert_close_tree(actual, expected, **tol)


def _modules_like_eager(module, x, steps=2):
    """Run ``module`` eagerly and a deep copy of it compiled for ``steps`` calls (training mode keeps its
    state between calls); compare outputs, input and parameter gradients, and buffers after each call."""
    eager = module
    compiled_module = copy.deepcopy(module)
    torch._dynamo.reset()
    compiled = compile_fn(compiled_module)
    before = driver.graphs_compiled()
    for step in range(steps):
        xe = (x * (step + 1)).requires_grad_(True)
        xc = (x * (step + 1)).requires_grad_(True)
        expected, actual = eager(xe), compiled(xc)
        _close(actual, expected)
        weights = torch.linspace(0.5, 1.5, expected.numel()).reshape(expected.shape)
        (expected.float() * weights).sum().backward()
        (actual.float() * weights).sum().backward()
        _close(xc.grad, xe.grad)
        for pe, pc in zip(eager.parameters(), compiled_module.parameters(), strict=True):
            _close(pc.grad, pe.grad)
        for (name, be), (_, bc) in zip(eager.named_buffers(), compiled_module.named_buffers(), strict=True):
            assert bc.dtype == be.dtype, name
            _close(bc, be)
    assert driver.graphs_compiled() > before, "tpucompile compiled no graph"


@pytest.mark.parametrize("kind", ["1d", "1d_seq", "2d", "2d_bf16_input"])
def test_batch_norm_train(kind):
    if kind == "2d":
        module, x = torch.nn.BatchNorm2d(6, momentum=0.3), torch.randn(4, 6, 3, 5) * 2 + 1
    elif kind == "2d_bf16_input":
        # f32 parameters and statistics, bf16 activations: the saved mean/rstd must stay f32 (as in eager),
        # or weight.grad, a sum of products with x - mean that cancel, is off by ~5e-2.
        module, x = torch.nn.BatchNorm2d(6), (torch.randn(4, 6, 3, 3) * 2 + 1).bfloat16()
    elif kind == "1d":
        module, x = torch.nn.BatchNorm1d(6), torch.randn(8, 6) * 2 - 1
    else:
        module, x = torch.nn.BatchNorm1d(6, affine=False), torch.randn(4, 6, 5) + 3
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    _modules_like_eager(module.train(), x)


def test_batch_norm_eval():
    trained = torch.nn.BatchNorm2d(6)
    with torch.no_grad():
        trained.running_mean.uniform_(-1, 1)
        trained.running_var.uniform_(0.5, 2)
        trained.weight.uniform_(0.5, 1.5)
        trained.bias.uniform_(-1, 1)
    _modules_like_eager(trained.eval(), torch.randn(2, 6, 3, 3))


def test_functional_batch_norm_without_running_stats():
    def fn(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True, eps=1e-3)

    assert_compiles_like_eager(fn, torch.randn(5, 4, 3), torch.rand(4) + 0.5, torch.randn(4), grad=True)


def test_group_norm_and_instance_norm():
    gn = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        gn.weight.uniform_(0.5, 1.5)
        gn.bias.uniform_(-1, 1)
    _modules_like_eager(gn, torch.randn(2, 6, 3, 3) * 2 + 1, steps=1)

    def fn(x, w, b):
        return (
            F.group_norm(x, 2, w, b, eps=1e-3),
            F.group_norm(x[..., 0], 6),
            F.instance_norm(x, weight=w, bias=b),
            F.instance_norm(x[:, :, 0]),
        )

    assert_compiles_like_eager(fn, torch.randn(2, 6, 4, 5), torch.rand(6) + 0.5, torch.randn(6), grad=True)


def test_instance_norm_module_with_running_stats():
    _modules_like_eager(torch.nn.InstanceNorm1d(4, affine=True, track_running_stats=True), torch.randn(3, 4, 7))
