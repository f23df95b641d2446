"""The XLA options tpucompile sets for CPU compiles: the memory-optimised instruction order, and the
optimisation level ``TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL`` asks for (this session sets 0: see conftest)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpucompile.runtime import compile_options, compile_options_fingerprint, get_target
from tpucompile.runtime import xla_options as target_module
from tpucompile.runtime.compiler import for_target
from tpucompile.runtime.xla_options import (
    CPU_OPTIMIZATION_LEVEL_VARIABLE,
    CPU_SCHEDULER,
    CPU_SCHEDULER_FLAG,
    cpu_option_overrides,
    describe_compile_options,
)


def _independent_branches(x):
    """Six products that need not wait for each other: a concurrency-first order keeps their inputs (made
    before the host BLAS calls, which nothing fuses into) alive together, a memory-first one reuses the
    buffers."""
    return sum(jnp.exp(x * i) @ x for i in range(6))


@pytest.fixture(scope="module")
def cpu():
    return get_target("cpu")


def test_cpu_compiles_take_the_memory_optimised_order(cpu):
    options = compile_options(cpu)
    assert (CPU_SCHEDULER_FLAG, CPU_SCHEDULER) in list(options.env_option_overrides)
    assert cpu.host_blas is not None, "this machine's torch has no BLAS tpucompile can call"
    lowered = jax.jit(_independent_branches).lower(jnp.ones((128, 128)))
    module = for_target(str(lowered.compiler_ir("stablehlo")), cpu)

    ours = cpu.client.compile_and_load(module, cpu.device_list(), options)
    default_options = _without(options, CPU_SCHEDULER_FLAG)
    default = cpu.client.compile_and_load(module, cpu.device_list(), default_options)

    # The override reaches XLA: its buffer assignment for the same program needs less scratch memory.
    ours_bytes = ours.get_compiled_memory_stats().temp_size_in_bytes
    default_bytes = default.get_compiled_memory_stats().temp_size_in_bytes
    assert ours_bytes < default_bytes, (ours_bytes, default_bytes)
    # and the cache key, which hashes the options, tells the two apart
    assert compile_options_fingerprint(options) != compile_options_fingerprint(default_options)
    assert f"('{CPU_SCHEDULER_FLAG}', '{CPU_SCHEDULER}')" in describe_compile_options(options)


@pytest.mark.parametrize("flag", ["--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_DEFAULT",
                                  "--xla_cpu_enable_concurrency_optimized_scheduler=true"])
def test_a_scheduler_chosen_in_xla_flags_is_left_to_xla(cpu, flag):
    assert cpu_option_overrides(cpu.client, {"XLA_FLAGS": f"--xla_cpu_enable_fast_math=false {flag}"}) == []
    assert cpu_option_overrides(cpu.client, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}) == [
        (CPU_SCHEDULER_FLAG, CPU_SCHEDULER)]


def test_an_option_this_xla_does_not_know_is_not_set(cpu, monkeypatch):
    monkeypatch.setattr(target_module, "_cpu_overrides", {})
    monkeypatch.setattr(target_module, "CPU_SCHEDULER_FLAG", "xla_cpu_scheduler_of_another_release")
    assert cpu_option_overrides(cpu.client, {}) == []
    monkeypatch.setattr(target_module, "_cpu_overrides", {})
    monkeypatch.setattr(target_module, "CPU_SCHEDULER_FLAG", CPU_SCHEDULER_FLAG)
    monkeypatch.setattr(target_module, "CPU_SCHEDULER", "CPU_SCHEDULER_TYPE_OF_ANOTHER_RELEASE")
    assert cpu_option_overrides(cpu.client, {}) == []


def _without(options: object, flag: str) -> object:
    """A copy of ``options`` without the override of ``flag``."""
    copy = type(options).ParseFromString(options.SerializeAsString())
    copy.env_option_overrides = [(name, value) for name, value in options.env_option_overrides if name != flag]
    return copy


def test_the_optimisation_level_asked_for_reaches_xla_and_the_key(cpu):
    level = ("xla_backend_optimization_level", 0)
    assert cpu_option_overrides(cpu.client, {CPU_OPTIMIZATION_LEVEL_VARIABLE: "0"}) == [
        (CPU_SCHEDULER_FLAG, CPU_SCHEDULER), level]
    assert level not in cpu_option_overrides(cpu.client, {})
    with pytest.raises(ValueError, match=f"{CPU_OPTIMIZATION_LEVEL_VARIABLE} .* not 'fast'"):
        cpu_option_overrides(cpu.client, {CPU_OPTIMIZATION_LEVEL_VARIABLE: "fast"})

    options = compile_options(cpu)
    assert level in list(options.env_option_overrides)  # this session's setting
    at_xla_default = _without(options, "xla_backend_optimization_level")
    assert compile_options_fingerprint(options) != compile_options_fingerprint(at_xla_default)
    # The same program compiled at both levels computes the same values (that level 0 compiles faster is
    # measured in docs/benchmarks.md, not asserted here).
    x = jnp.linspace(-2.0, 2.0, 128 * 128, dtype=jnp.float32).reshape(128, 128)
    module = for_target(str(jax.jit(_independent_branches).lower(x).compiler_ir("stablehlo")), cpu)
    argument = jax.device_put(x, cpu.client.devices()[0])
    results = []
    for chosen in (options, at_xla_default):
        executable = cpu.client.compile_and_load(module, cpu.device_list(), chosen)
        results.append(np.asarray(executable.execute([argument])[0]))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    np.testing.assert_allclose(results[0], np.asarray(_independent_branches(x)), rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the tpu extra) is not installed")
def test_the_cpu_optimisation_level_leaves_tpu_compiles_alone():
    from tpucompile.runtime.targets.compile_only import compile_targets

    (tpu,) = compile_targets(("tpu:v5e:1x1",))
    options = compile_options(tpu)
    assert "xla_backend_optimization_level" not in dict(options.env_option_overrides)
    assert options.executable_build_options.debug_options.xla_backend_optimization_level != 0
