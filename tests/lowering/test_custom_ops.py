"""Libraries' own ops (``torch.library.custom_op``): traced through their implementations when they trace,
lowered by a registered JAX function (``tpucompile.register_lowering``), else run in eager PyTorch."""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch

import tpucompile
from tests.support import assert_close_tree
from tpucompile import driver
from tpucompile.config import Options

TARGET = "tpu:v5e:1x1"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")


@torch.library.custom_op("tpucompile_custom_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("tpucompile_custom_test::scaled_tanh_backward", mutates_args=())
def scaled_tanh_backward(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return grad * scale  # straight through: not tanh's derivative, so the test sees which formula ran


@scaled_tanh_backward.register_fake
def _(grad, scale):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    return scaled_tanh_backward(grad, ctx.scale), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("tpucompile_custom_test::host_cube", mutates_args=())
def host_cube(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy() ** 3)  # numpy: cannot be traced


@host_cube.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("tpucompile_custom_test::misdeclared", mutates_args=())
def misdeclared(x: torch.Tensor) -> torch.Tensor:
    return x.double() * 2  # not what its fake implementation says: traced, the graph would be wrong


@misdeclared.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("tpucompile_custom_test::shifted_sine", mutates_args=())
def shifted_sine(x: torch.Tensor, shift: float) -> torch.Tensor:
    return torch.from_numpy(__import__("numpy").sin(x.numpy() + shift))  # only a JAX lowering compiles it


@shifted_sine.register_fake
def _(x, shift):
    return torch.empty_like(x)


@torch.library.custom_op("tpucompile_custom_test::sine", mutates_args=())
def sine(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x)


@sine.register_fake
def _(x):
    return torch.empty_like(x)


def _jax_shifted_sine(x, shift):
    import jax.numpy as jnp

    return jnp.sin(x + shift)


def _jax_shifted_sine_again(x, shift):
    import jax.numpy as jnp

    return jnp.sin(shift + x)  # the same values from another source: another key


def _jax_sine_by_cosine(x):
    import jax.numpy as jnp

    return jnp.cos(x - math.pi / 2)


def _jax_sine(x):
    import jax.numpy as jnp

    return jnp.sin(x)


@pytest.fixture
def registrations():
    """Registrations made by the test (``(op, platform)``), removed after it."""
    made: list = []
    yield made
    for op, platform in made:
        tpucompile.remove_lowering(op, platform=platform)


@pytest.fixture
def events(compile_events):
    return compile_events


def _calls(events) -> set[str]:
    return {str(node.target) for event in events if event.graph is not None
            for node in event.graph.graph.nodes if node.op == "call_function"}


def _tiny_moe_block() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The MoE block of a one-layer Qwen3-MoE (grouped-matmul experts), and a copy, with random weights (the
    router's are zeros at initialisation, which would send every token to the same experts)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    blocks = [Qwen3MoeForCausalLM(config).model.layers[0].mlp for _ in range(2)]
    with torch.no_grad():
        for parameter in blocks[0].parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    blocks[1].load_state_dict(blocks[0].state_dict())
    return blocks[0], blocks[1]


def test_transformers_moe_block_compiles_whole_forward_and_backward(events):
    eager, model = _tiny_moe_block()
    x = torch.randn(2, 7, 32)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(model, backend="tpucompile", fullgraph=True)  # the session's fallback is "error"
    out = compiled(x_compiled)
    out.pow(2).sum().backward()
    expected = eager(x_eager)
    expected.pow(2).sum().backward()
    tolerance = {"atol": 1e-4, "rtol": 1e-4}  # float32 sums of products over 32 and 16, in another order
    assert_close_tree(out, expected, **tolerance)
    assert_close_tree(x_compiled.grad, x_eager.grad, **tolerance)
    assert_close_tree({n: p.grad for n, p in model.named_parameters()},
                      {n: p.grad for n, p in eager.named_parameters()}, **tolerance)
    calls = _calls(events)
    assert {"transformers.grouped_mm_fallback.default", "transformers.grouped_mm_fallback_backward.default"} <= calls
    assert any("jax_transformers__grouped_mm_fallback_backward" in e.program.text() for e in events)


def test_grouped_matmul_with_an_empty_group_and_rows_past_the_last_offset():
    import transformers.integrations.moe  # noqa: F401  (defines the op)

    x, weight = torch.randn(9, 5), torch.randn(3, 5, 4)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)  # expert 1 gets no rows; rows 7 and 8 none at all
    compiled = torch.compile(lambda *a: torch.ops.transformers.grouped_mm_fallback(*a), backend="tpucompile")
    assert_close_tree(compiled(x, weight, offs), torch.ops.transformers.grouped_mm_fallback(x, weight, offs))


def test_a_traceable_implementation_compiles_with_its_registered_backward(events):
    def fn(x):
        return scaled_tanh(x * 2, 3.0).sum(-1)

    x = torch.randn(4, 5)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = torch.compile(fn, backend="tpucompile", fullgraph=True)(x_compiled)  # fallback "error": no eager op
    out.sum().backward()
    expected = fn(x_eager)
    expected.sum().backward()
    assert_close_tree(out, expected)
    assert_close_tree(x_compiled.grad, x_eager.grad)  # the straight-through formula: 6 everywhere
    assert torch.equal(x_eager.grad, torch.full_like(x, 6.0))
    calls = _calls(events)
    assert "aten.tanh.default" in calls and not any("tpucompile_custom_test" in c for c in calls)
    whole = driver.custom_ops_lowered_whole(driver.resolve_targets(Options()))
    assert "tpucompile::attention" in whole  # its own lowering stays


def test_an_implementation_that_cannot_be_traced_runs_in_eager_with_the_warning():
    def fn(x):
        return host_cube(x + 1) * 2, misdeclared(x)  # the latter's eager result goes straight out

    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="tpucompile", options={"fallback": "eager"})(x)
    assert_close_tree(out, fn(x))
    messages = [str(w.message) for w in caught]
    for op in ("host_cube", "misdeclared"):
        assert any(f"tpucompile runs tpucompile_custom_test.{op}.default in eager PyTorch: no lowering for" in m
                   for m in messages), messages


def test_a_registered_jax_lowering_compiles_the_op(registrations, events):
    tpucompile.register_lowering(torch.ops.tpucompile_custom_test.shifted_sine, _jax_shifted_sine)
    registrations.append(("tpucompile_custom_test::shifted_sine", None))

    def fn(x):
        return shifted_sine(x * 2, 0.5) + 1

    x = torch.randn(3, 4)
    out = torch.compile(fn, backend="tpucompile", fullgraph=True)(x)
    assert_close_tree(out, fn(x))
    assert "tpucompile_custom_test.shifted_sine.default" in _calls(events)
    text = events[-1].program.text()
    assert "call @jax_tpucompile_custom_test__shifted_sine_" in text and "stablehlo.sine" in text


def test_a_jax_lowering_of_the_wrong_shape_is_an_error_naming_the_op_and_the_line(registrations):
    @tpucompile.register_lowering("tpucompile_custom_test::shifted_sine")
    def summed(x, shift):
        return (x + shift).sum(0)

    registrations.append(("tpucompile_custom_test::shifted_sine", None))

    def fn(x):
        return shifted_sine(x, 0.5)  # the line the error names

    with pytest.raises(Exception) as caught:
        torch.compile(fn, backend="tpucompile")(torch.randn(3, 4))
    message = str(caught.value)
    assert "JAX lowering of tpucompile_custom_test::shifted_sine" in message
    assert "float32[4]" in message and "float32[3, 4]" in message
    assert f"{__file__}:{fn.__code__.co_firstlineno + 1}" in message


@needs_libtpu
def test_a_platform_lowering_is_used_for_a_tpu_target_and_not_for_the_cpu(registrations, events):
    tpucompile.register_lowering(sine, _jax_sine_by_cosine, platform="tpu")
    registrations.append(("tpucompile_custom_test::sine", "tpu"))

    def fn(x):
        return sine(x) * 2

    x = torch.randn(8, 128)
    out = torch.compile(fn, backend="tpucompile")(x)  # the CPU: no lowering for it, the implementation traced
    assert_close_tree(out, fn(x))
    assert "aten.sin.default" in _calls(events) and "tpucompile_custom_test.sine.default" not in _calls(events)

    events.clear()
    torch._dynamo.reset()
    options = {"targets": [TARGET], "cache_mode": "off"}
    meta = torch.compile(fn, backend="tpucompile", options=options)(torch.empty(8, 128, device="meta"))
    assert meta.shape == (8, 128)
    [event] = [e for e in events if e.target is not None]
    assert event.error is None and TARGET in event.target
    assert "stablehlo.cosine" in event.program.text() and "stablehlo.sine" not in event.program.text()

    tpucompile.register_lowering(sine, _jax_sine)  # for every other platform: the CPU now uses it
    registrations.append(("tpucompile_custom_test::sine", None))
    events.clear()
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tpucompile")(x)
    assert_close_tree(out, fn(x))
    text = events[-1].program.text()
    assert "call @jax_tpucompile_custom_test__sine_" in text and "stablehlo.cosine" not in text


def test_the_program_key_holds_the_digest_of_the_lowering_s_source(registrations, events):
    def fn(x):
        return shifted_sine(x, 0.25) * 3

    def compile_with(lowering):
        tpucompile.register_lowering(shifted_sine, lowering)
        registrations.append(("tpucompile_custom_test::shifted_sine", None))
        events.clear()
        torch._dynamo.reset()
        x = torch.randn(5, 6)
        assert_close_tree(torch.compile(fn, backend="tpucompile")(x), fn(x))
        [event] = events
        return event.program.cache_key  # computed before lowering: from the graph and the registration

    first_key = compile_with(_jax_shifted_sine)
    second_key = compile_with(_jax_shifted_sine_again)
    again_key = compile_with(_jax_shifted_sine)
    assert first_key is not None and first_key != second_key
    assert again_key == first_key


def test_register_lowering_refuses_what_it_cannot_lower():
    import tpucompile.contracts.attention_ops  # defines tpucompile::attention

    with pytest.raises(ValueError, match=r"aten::add\.Tensor is not a custom op"):
        tpucompile.register_lowering(torch.ops.aten.add.Tensor, _jax_sine)
    with pytest.raises(ValueError, match="tpucompile lowers tpucompile::attention itself"):
        tpucompile.register_lowering(torch.ops.tpucompile.attention, _jax_sine)
    with pytest.raises(ValueError, match="platform must be one of"):
        tpucompile.register_lowering(sine, _jax_sine, platform="gpu")
    with pytest.raises(TypeError, match="must be a JAX function"):
        tpucompile.register_lowering(sine, 3)
    with pytest.raises(TypeError, match="neither source nor code"):
        tpucompile.register_lowering(sine, len)
    assert not tpucompile.remove_lowering(sine)  # nothing was registered


def test_an_untraceable_op_lowered_only_for_tpus_runs_in_eager_on_the_cpu(registrations):
    tpucompile.register_lowering(shifted_sine, _jax_shifted_sine, platform="tpu")
    registrations.append(("tpucompile_custom_test::shifted_sine", "tpu"))

    def fn(x):
        return shifted_sine(x + 1, 0.5)

    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="tpucompile", options={"fallback": "eager"})(x)
    assert_close_tree(out, fn(x))
    assert any("tpucompile runs tpucompile_custom_test.shifted_sine.default in eager PyTorch" in str(w.message)
               for w in caught)


def _plan_components() -> dict:
    """The key components of a cached plan of a Dynamo graph calling ``shifted_sine``."""
    import torch._functorch.config  # read by the plan key

    from tpucompile import plan_replay

    gm = torch.fx.symbolic_trace(lambda x: torch.ops.tpucompile_custom_test.shifted_sine(x, 0.5))
    options = Options.from_sources(None)
    return plan_replay.plan_components(gm, [torch.randn(3)], options, driver.resolve_targets(options))


def test_a_cached_plan_s_key_holds_the_lowering_s_source(registrations):
    traced = _plan_components()
    tpucompile.register_lowering(shifted_sine, _jax_shifted_sine)
    registrations.append(("tpucompile_custom_test::shifted_sine", None))
    first = _plan_components()
    tpucompile.register_lowering(shifted_sine, _jax_shifted_sine_again)
    second = _plan_components()
    def ours(components):
        return [entry for entry in components["jax_lowerings"] if entry[0] == "tpucompile_custom_test::shifted_sine"]

    assert ours(traced) == [] and first["decompositions"] != traced["decompositions"]  # now kept whole
    assert ours(first) and ours(second) and ours(first) != ours(second)
    assert first["decompositions"] == second["decompositions"]


def test_a_cached_plan_s_key_holds_the_traced_implementation_s_source(tmp_path):
    import importlib.util

    digests = []
    for version, body in enumerate(["torch.cos(x)", "torch.cos(x) * 1"]):
        path = tmp_path / f"versioned_op_{version}.py"
        path.write_text("import torch\n\n"
                        "@torch.library.custom_op('tpucompile_custom_test::versioned', mutates_args=())\n"
                        f"def versioned(x: torch.Tensor) -> torch.Tensor:\n    return {body}\n")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        digests.append(_plan_components()["decompositions"])
    assert digests[0] != digests[1]
