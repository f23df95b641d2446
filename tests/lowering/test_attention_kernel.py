"""Attention through ``tpucompile::attention`` (the op a TPU compiles to jax's Pallas splash-attention
kernel): the op's choice, its math lowering against eager (forward and backward), the kernel's numerics in
Pallas' interpret mode against the math form and against eager, and the kernel in the programs compiled for a
TPU target."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager
from tpucompile import driver

KERNEL_OPS = {torch.ops.tpucompile.attention.default, torch.ops.tpucompile.attention_backward.default}
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')


def _qkv(dtype, heads=4, kv_heads=4, length=256, head_dim=128, batch=2):
    generator = torch.Generator().manual_seed(0)
    shapes = [(batch, heads, length, head_dim)] + [(batch, kv_heads, length, head_dim)] * 2
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_op_lowers_to_the_math_form_off_tpu_and_matches_eager(aten_ops, causal, dtype):
    """``attention="kernel"`` on the CPU: the op pair reaches the lowering (its math form there, scores
    recomputed in the backward from the saved log-sum-exp), and values and gradients equal eager's."""
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype is torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    assert_compiles_like_eager(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               *_qkv(dtype), grad=True, attention="kernel", **tolerance)
    assert aten_ops >= KERNEL_OPS


def test_grouped_query_attention_goes_through_the_kernel_op(aten_ops):
    q, k, v = _qkv(torch.float32, heads=8, kv_heads=2, length=128)
    assert_compiles_like_eager(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3),
        q, k, v, grad=True, attention="kernel", atol=1e-4, rtol=1e-4)
    assert aten_ops >= KERNEL_OPS


@pytest.mark.parametrize("case", ["head-24", "length-200", "random-mask", "dropout-free-math-mode",
                                  "broadcast-heads"])
def test_calls_the_kernel_does_not_take_keep_the_math_form(aten_ops, case):
    """Including one key/value head broadcast over the query heads without ``enable_gqa`` (PyTorch broadcasts
    it; only grouped-query attention goes to the kernel with fewer key/value heads)."""
    q, k, v = _qkv(torch.float32, head_dim=24) if case == "head-24" else _qkv(
        torch.float32, length=200 if case == "length-200" else 128, kv_heads=1 if case == "broadcast-heads" else 4)
    mask = torch.rand(q.shape[-2], k.shape[-2]) > 0.3 if case == "random-mask" else None
    mode = "math" if case == "dropout-free-math-mode" else "kernel"
    assert_compiles_like_eager(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               q, k, v, grad=True, attention=mode, atol=1e-4, rtol=1e-4)
    assert not KERNEL_OPS & aten_ops


MASKS = {"causal": (-1, 0, False), "full": (-1, -1, False), "window": (47, 0, False),
         "causal-padding": (-1, 0, True), "window-padding": (15, 0, True), "padding": (-1, -1, True),
         "band": (-1, 3, False)}


_HEADS = {"mha": (4, 4), "mqa": (4, 1), "gqa": (8, 2)}
_CASES = [(mask, "mha") for mask in MASKS] + [(mask, heads) for mask in ("causal-padding", "window")
                                              for heads in ("mqa", "gqa")]


_FALLBACK_CASES = [("causal-padding", "gqa"), ("window", "mha")]


@pytest.mark.parametrize(("mask", "heads", "private_backward"),
                         [(*case, True) for case in _CASES] + [(*case, False) for case in _FALLBACK_CASES],
                         ids=[f"{m}-{h}" for m, h in _CASES] + [f"{m}-{h}-recomputed" for m, h in _FALLBACK_CASES])
def test_splash_kernel_in_interpret_mode_equals_the_math_form(mask, heads, private_backward, monkeypatch):
    """The TPU lowering's jax functions (splash attention's forward with its log-sum-exp, and its backward
    passes fed the saved output and log-sum-exp) run by Pallas' TPU interpreter on the CPU, for every mask
    the op describes, over 3 tiles of 128 (so the band's skipped and partial tiles are both exercised); with
    a band and padding, the first 40 rows of one batch row see no key (zeros, lse -inf). The "recomputed"
    cases take the backward used where jax lacks the private passes (the kernel's own VJP)."""
    import functools

    import jax
    import jax.numpy as jnp

    from tpucompile.lowering.rules import attention

    if not private_backward:
        monkeypatch.setattr(attention, "_private_backward", lambda: None)
    left, right, padded = MASKS[mask]
    heads, kv_heads = _HEADS[heads]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    grad_out, query = (jax.random.normal(k, (2, heads, 384, 64), jnp.float32) for k in keys[:2])
    key, value = (jax.random.normal(k, (2, kv_heads, 384, 64), jnp.float32) for k in keys[2:])
    valid = jnp.ones((2, 384), bool).at[1, :40].set(False).at[0, 300:].set(False) if padded else None
    options = dict(left=left, right=right, scale=0.15)
    out, lse = jax.jit(functools.partial(attention.splash_forward, interpret=True, **options))(
        query, key, value, valid)
    grads = jax.jit(functools.partial(attention.splash_backward, interpret=True, **options))(
        grad_out, query, key, value, out, lse, valid)
    expected_out, expected_lse = attention.math_forward(query, key, value, valid, **options)
    expected_grads = attention.math_backward(grad_out, query, key, value, expected_out, expected_lse, valid,
                                             **options)
    assert bool(jnp.all(jnp.isneginf(lse) == jnp.isneginf(expected_lse)))
    assert bool(jnp.any(jnp.isneginf(lse))) == (mask in ("causal-padding", "window-padding"))
    for got, expected in zip([out, lse, *grads], [expected_out, expected_lse, *expected_grads], strict=True):
        difference = jnp.where(jnp.isneginf(expected), 0.0, got - expected)
        assert float(jnp.max(jnp.abs(difference))) < 1e-4


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_kernel_route_in_interpret_mode_matches_eager_for_each_head_size(head_dim):
    """``attention="interpret"``: the whole compiled program calls the splash kernel, run by Pallas'
    interpreter, forward and backward, with a causal mask and grouped-query heads; values equal eager's."""
    q, k, v = _qkv(torch.float32, heads=4, kv_heads=2, length=128, head_dim=head_dim, batch=1)
    assert_compiles_like_eager(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        q, k, v, grad=True, attention="interpret", atol=1e-4, rtol=1e-4)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_query_scaled_in_the_graph_equals_scaling_inside_the_kernel(compile_events, dtype):
    """``prescale_attention_query`` (on by default): the forward graph multiplies the query by the scale and
    calls the kernel op with scale 1, so the backward receives the scaled query; off, the op carries the
    scale. Both routes, run by Pallas' interpreter, give the output and gradients of float64 eager within the
    input dtype's precision (float32: to 1e-4 elementwise; bfloat16, where single elements of eager's
    own result are several units in the last place off: 1% of the norm), and each other's."""
    q, k, v = _qkv(dtype, heads=4, kv_heads=2, length=128, head_dim=64, batch=2)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)

    def run(fn, inputs):
        inputs = [t.clone().requires_grad_() for t in inputs]
        out = fn(*inputs)
        out.float().square().sum().backward()
        return [out.detach(), *(t.grad for t in inputs)]

    expected = run(attend, [t.double() for t in (q, k, v)])
    results = {}
    for prescale in (True, False):
        compile_events.clear()
        torch._dynamo.reset()
        results[prescale] = run(torch.compile(attend, backend="tpucompile", options={
            "attention": "interpret", "prescale_attention_query": prescale, "cache_mode": "off"}), (q, k, v))
        forward = next(e.graph for e in compile_events if e.name.endswith("(forward)"))
        calls = [n for n in forward.graph.nodes if n.target is torch.ops.tpucompile.attention.default]
        assert len(calls) == 1
        query_producer = calls[0].args[0]
        if prescale:
            assert calls[0].args[-1] == 1.0
            assert query_producer.target is torch.ops.aten.mul.Tensor and query_producer.args[1] == 0.3
        else:
            assert calls[0].args[-1] == 0.3 and query_producer.op == "placeholder"
        for actual, reference in zip(results[prescale], expected, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(actual, reference.float(), atol=1e-4, rtol=1e-4)
            else:
                assert _relative_error(actual, reference) < 1e-2
    for on, off in zip(results[True], results[False], strict=True):
        assert _relative_error(on, off) < (1e-6 if dtype == torch.float32 else 1e-2)


@needs_libtpu
@pytest.mark.parametrize("mode", ["auto", "math"])
def test_programs_for_a_tpu_target_call_the_kernel_and_the_cpu_program_does_not(mode):
    events = []
    remove = driver.add_observer(events.append)
    try:
        q, k, v = (t.requires_grad_() for t in _qkv(torch.bfloat16, length=128))
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           backend="tpucompile",
                           options={"targets": ["tpu:v5e:1x1"], "attention": mode, "cache_mode": "off"})
        fn(q, k, v).float().square().sum().backward()
    finally:
        remove()
    on_tpu = [e for e in events if e.target == "tpu:v5e:1x1"]
    on_cpu = [e for e in events if e.target is None]
    assert len(on_tpu) == 2 and len(on_cpu) == 2, [(e.name, e.target) for e in events]
    # Our kernel's calls are named after the op; XLA's TPU compiler may put a kernel of its own (an
    # "online-softmax" custom call) into the math form's bf16 products, which is not ours to count.
    kernel_calls = [any("tpu_custom_call" in line and "%tpucompile.attention" in line
                        for m in e.executable.hlo_modules() for line in m.to_string().splitlines())
                    for e in on_tpu]
    assert kernel_calls == [mode == "auto"] * 2
    assert not any("tpu_custom_call" in e.program.text() for e in on_cpu)


@needs_libtpu
def test_multihead_attention_for_a_tpu_target_calls_the_kernel(compile_events):
    """``nn.MultiheadAttention`` hides its attention inside one call Dynamo keeps whole; compiled for a TPU,
    that attention still reaches the kernel, forward and backward, and on the CPU the same step equals eager."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(256, 2, batch_first=True).to(torch.bfloat16)  # head size 128
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    out = torch.compile(module, backend="tpucompile",
                        options={"targets": ["tpu:v5e:1x1"], "cache_mode": "off"})(*[leaves[0]] * 3,
                                                                                    need_weights=False)[0]
    out.float().square().sum().backward()
    expected = module(*[leaves[1]] * 3, need_weights=False)[0]
    expected.float().square().sum().backward()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, atol=5e-2, rtol=5e-2)
    on_tpu = [e for e in compile_events if e.target == "tpu:v5e:1x1"]
    assert len(on_tpu) == 2, [(e.name, e.target) for e in compile_events]
    assert all("tpu_custom_call" in "".join(m.to_string() for m in e.executable.hlo_modules()) for e in on_tpu)


class _MaskedAttention(torch.nn.Module):
    """Two heads of 32 over 64 features, with a causal and padding mask built in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 32).permute(2, 0, 3, 1, 4)
        rows, columns = torch.arange(n)[:, None], torch.arange(n)[None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=(columns <= rows) & pad.bool()[:, None, None, :])
        return self.out(y.transpose(1, 2).reshape(b, n, 64))


def test_whole_step_under_torch_func_takes_the_kernel_and_matches_eager(aten_ops):
    """A training step written with ``torch.func.grad_and_value`` over ``functional_call`` (one graph, forward
    and backward): its attention goes through the kernel op too, run by Pallas' interpreter, and the loss
    and gradients equal eager's."""
    torch.manual_seed(0)
    model = _MaskedAttention()

    def step(params, x, pad):
        def loss(values):
            return torch.func.functional_call(model, values, (x, pad)).square().mean()
        return torch.func.grad_and_value(loss)(params)

    x, pad = torch.randn(2, 128, 64), torch.ones(2, 128, dtype=torch.long)
    pad[0, 100:] = 0
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    actual = torch.compile(step, backend="tpucompile", options={"attention": "interpret", "cache_mode": "off"})(
        params, x, pad)
    expected = step(params, x, pad)
    assert aten_ops >= KERNEL_OPS
    torch.testing.assert_close(actual[1], expected[1], atol=1e-5, rtol=1e-5)
    for name in params:
        torch.testing.assert_close(actual[0][name], expected[0][name], atol=1e-5, rtol=1e-4)


def test_a_mesh_splits_the_kernel_over_batch_rows_and_key_value_heads():
    """Where a sharded program runs the kernel: data-like axes on the batch, "model" on the key/value heads,
    each where it divides what is left, else nowhere."""
    from tpucompile.lowering.rules.attention import split_axes

    assert split_axes((("data", 64),), 64, 8) == (("data",), ())
    assert split_axes((("data", 16), ("model", 4)), 16, 8) == (("data",), ("model",))
    assert split_axes((("data", 4), ("model", 4)), 64, 2) == (("data", "model"), ())  # 2 heads: model on batch
    assert split_axes((("model", 8),), 8, 8) == ((), ("model",))
    assert split_axes((("data", 8),), 2, 4) == ((), ())  # divides neither: every device the whole call
    assert split_axes((("fsdp", 2), ("data", 4)), 16, 8) == (("fsdp", "data"), ())


@needs_libtpu
def test_a_sharded_tpu_program_runs_the_kernel_on_each_chips_block():
    """Planned for 4 chips with the batch split over them (meta tensors: nothing runs here), the kernel call
    in the forward and backward takes one chip's batch row, and no collective moves the query, key or value:
    without the manual computation XLA gathers all four rows onto every chip and runs them all there."""
    from tpucompile import Mesh, data_parallel

    mesh = Mesh({"data": 4})
    events = []
    remove = driver.add_observer(events.append)
    try:
        q, k, v = (torch.empty(s, dtype=torch.bfloat16, device="meta").requires_grad_()
                   for s in [(4, 8, 256, 128), (4, 2, 256, 128), (4, 2, 256, 128)])
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                           backend="tpucompile", options={"targets": ["tpu:v5e:2x2"], "mesh": mesh,
                                                          "shard": data_parallel(mesh), "cache_mode": "off"})
        fn(q, k, v).float().square().sum().backward()
    finally:
        remove()
    on_tpu = [e for e in events if e.target == "tpu:v5e:2x2" and e.error is None]
    assert len(on_tpu) == 2, [(e.name, e.target, e.error) for e in events]
    for event in on_tpu:
        assert "sdy.manual_computation" in event.program.text()
        lines = [line for m in event.executable.hlo_modules() for line in m.to_string().splitlines()]
        calls = [line for line in lines if "tpu_custom_call" in line and "%tpucompile.attention" in line]
        # the grouped query block per call: (key/value heads, group, length, head size) of one batch row
        assert calls and all("bf16[2,4,256,128]" in line and "[4,2,4,256,128]" not in line for line in calls), calls
        gathered = [line for line in lines if re.search(r"= \S+ all-(gather|reduce)\(", line)]
        if event.name.endswith("(forward)"):  # only the output, which comes back whole
            assert len(gathered) == 1 and "bf16[4,8,256,128]" in gathered[0], gathered
