"""The XLA options tpucompile sets for CPU compiles: the memory-optimised instruction order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tpucompile.runtime import compile_options, compile_options_fingerprint, get_target
from tpucompile.runtime import xla_options as target_module
from tpucompile.runtime.compiler import for_target
from tpucompile.runtime.xla_options import (
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
    assert list(options.env_option_overrides) == [(CPU_SCHEDULER_FLAG, CPU_SCHEDULER)]
    assert cpu.host_blas is not None, "this machine's torch has no BLAS tpucompile can call"
    lowered = jax.jit(_independent_branches).lower(jnp.ones((128, 128)))
    module = for_target(str(lowered.compiler_ir("stablehlo")), cpu)

    ours = cpu.client.compile_and_load(module, cpu.device_list(), options)
    default_options = type(options).ParseFromString(options.SerializeAsString())
    default_options.env_option_overrides = []
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
