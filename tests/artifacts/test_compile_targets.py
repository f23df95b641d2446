"""Compile-only targets: graphs compiled for a TPU slice (``tpu:v5e:2x2``) on a machine without a TPU, keyed as
a host of that slice keys them, dumped with memory per chip, warmed into the cache, exported and imported.

Names, options and messages are checked everywhere; what needs libtpu (the ``tpu`` extra) is skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests import python_processes
from tests.cached_runs import compile_and_run
from tpucompile import cli
from tpucompile.cache import PersistentCache
from tpucompile.config import Options
from tpucompile.contracts import target_names
from tpucompile.errors import OptionsError
from tpucompile.runtime import build_flags
from tpucompile.runtime.targets import libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = "tpu:v5e:2x2"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')
TILED = re.compile(r"\{[0-9,]+:T\(\d+(,\d+)?\)")


# -- names, options, flags, messages: no libtpu needed ---------------------------------------------------


def test_target_names_parse_and_bad_ones_list_the_valid_forms():
    assert str(target_names.parse("TPU:v5e:2x2")) == TARGET and target_names.parse(TARGET).topology == "2x2x1"
    assert target_names.parse("tpu:v5p:2x2x1").chips == 4 and target_names.parse("cpu").compile_only is False
    for bad in ("tpu:v9:2x2", "tpu:v5e:2x2x1", "tpu:v5p:2x2", "gpu", "tpu:v5e:2y2", "cpu:v5e:2x2"):
        with pytest.raises(OptionsError, match="valid targets are tpu:v5e:AxB, tpu:v6e:AxB or tpu:v5p:AxBxC"):
            target_names.parse(bad)


def test_targets_option_and_environment_variable():
    assert Options.from_sources({"targets": [TARGET, "tpu:V5E:2x2", "cpu"]}).targets == (TARGET, "cpu")
    assert Options.from_sources(environ={"TPUCOMPILE_TARGETS": f"{TARGET},tpu:v6e:2x4"}).targets == (
        TARGET, "tpu:v6e:2x4")
    assert Options().targets == ()
    with pytest.raises(OptionsError, match="unknown TPU generation 'v9'"):
        Options.from_sources({"targets": ["tpu:v9:2x2"]})


def test_labels_name_the_target_from_key_components():
    assert target_names.label({"platform": "tpu", "device_kind": "TPU v5 lite", "topology": "2x2x1"}) == TARGET
    assert target_names.label({"platform": "tpu", "device_kind": "TPU v5", "topology": "2x2x1"}) == "tpu:v5p:2x2x1"
    assert target_names.label({"platform": "cpu", "topology": "1 device"}) == "cpu"
    assert target_names.label({"kind": "plan"}) == "-"
    assert target_names.describe_topology([(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)], 1, 4) == "2x2x1"
    assert target_names.describe_topology([], 1, 8) == "8 devices"


def test_tpu_keys_ignore_cpu_flags_and_the_launch_barrier_jax_sets_on_tpu_vms():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=true "
                            "--xla_backend_optimization_level=2",
               "LIBTPU_INIT_ARGS": "--xla_tpu_use_enhanced_launch_barrier=true"}
    assert build_flags(environ, platform="tpu") == ["xla_backend_optimization_level=2"]
    assert "xla_cpu_enable_fast_math=true" in build_flags(environ)


def test_missing_or_mismatched_libtpu_says_exactly_what_to_install(monkeypatch):
    assert libtpu._satisfies("0.0.42.1", "==0.0.42.*") and not libtpu._satisfies("0.0.41", "==0.0.42.*")
    monkeypatch.setattr(libtpu, "required_version", lambda: "==0.0.42.*")
    monkeypatch.setattr(libtpu, "installed_version", lambda: None)
    with pytest.raises(OptionsError) as missing:
        libtpu.check_installed(TARGET)
    assert f"compiling for {TARGET} needs libtpu, which is not installed: pip install \"tpucompile[tpu]\"" in str(
        missing.value) and 'pip install "libtpu==0.0.42.*"' in str(missing.value)
    monkeypatch.setattr(libtpu, "installed_version", lambda: "0.0.40")
    with pytest.raises(OptionsError, match=r'libtpu 0.0.40 is installed: pip install "libtpu==0.0.42.\*"'):
        libtpu.check_installed(TARGET)


def test_quiet_drops_only_libtpus_start_up_noise(capfd):
    with libtpu.quiet():
        os.write(2, b"Failed to find host bounds for accelerator type: WARNING: could not determine TPU "
                    b"accelerator type, please set env var `TPU_ACCELERATOR_TYPE` manually\n"
                    b"=== Source Location Trace: ===\nlearning/x/libtpu_init_utils.cc:327\nsomething real\n")
    assert capfd.readouterr().err == "something real\n"


# -- with libtpu ----------------------------------------------------------------------------------------


@needs_libtpu
def test_key_components_come_from_the_topology():
    from tpucompile import artifacts
    from tpucompile.runtime.targets.compile_only import compile_only_target, compile_targets

    target = compile_only_target(TARGET)
    environment = artifacts.environment(target)
    assert environment["platform"] == "tpu" and environment["device_kind"] == "TPU v5 lite"
    assert environment["platform_version"].startswith("PJRT C API\nTFRT TPU v5 lite\n")
    assert environment["device_count"] == 1 and environment["topology"] == "2x2x1"
    assert len(target.client.devices()) == 4 and target.compile_only
    assert compile_targets(("cpu", TARGET, "tpu:V5E:2x2")) == (target,)  # cpu is this process's own platform
    with pytest.raises(OptionsError, match=r"libtpu has no topology 'tpu:v5e:3x3'.*valid targets are"):
        compile_only_target("tpu:v5e:3x3")


def mlp(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


@needs_libtpu
def test_each_graph_is_also_compiled_for_the_target_and_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path))
    x, w1, w2 = torch.randn(128, 256), torch.randn(256, 512) / 16, torch.randn(512, 128) / 16
    result, events = compile_and_run(mlp, x, w1, w2, targets=[TARGET])
    torch.testing.assert_close(result, mlp(x, w1, w2), atol=1e-4, rtol=1e-4)
    local, tpu = events
    assert local.target is None and tpu.target == TARGET and tpu.error is None and not tpu.cache_hit
    assert tpu.key_components["platform"] == "tpu" and tpu.key_components["topology"] == "2x2x1"
    assert tpu.key_components["program"] == local.key_components["program"]  # nothing platform-specific in it
    assert TILED.search(tpu.executable.hlo_modules()[0].to_string())
    memory = tpu.report["memory"]
    assert memory["argument"] == 4 * (128 * 256 + 256 * 512 + 512 * 128) and memory["output"] == 4 * 128 * 128
    assert tpu.report["flops"] >= 2 * 128 * 256 * 512
    (entry, _) = PersistentCache(tmp_path).get(tpu.key)
    assert entry.metadata["target"] == TARGET and entry.metadata["report"] == tpu.report and entry.payload
    _, again = compile_and_run(mlp, x, w1, w2, targets=[TARGET])
    assert [e.cache_hit for e in again] == [True, True] and again[1].report == tpu.report


@needs_libtpu
def test_programs_with_jax_lowered_ops_are_lowered_again_for_the_tpu(monkeypatch):
    monkeypatch.setenv("TPUCOMPILE_CACHE_MODE", "off")
    a = torch.randn(8, 8) + 8 * torch.eye(8)
    result, (local, tpu) = compile_and_run(torch.linalg.inv, a, targets=[TARGET])
    torch.testing.assert_close(result, torch.linalg.inv(a))
    assert "lapack" in local.program.text() and "lapack" not in tpu.program.text()
    assert "LuDecomposition" in tpu.program.text() and tpu.error is None


@needs_libtpu
def test_a_program_the_target_cannot_compile_names_graph_op_line_and_target(monkeypatch):
    monkeypatch.setenv("TPUCOMPILE_CACHE_MODE", "off")
    a = torch.ones(4, 4, dtype=torch.int64)

    def integer_matmul(x):
        return x @ x

    with pytest.warns(UserWarning, match="cannot be compiled for tpu:v5e:2x2"):
        result, (local, tpu) = compile_and_run(integer_matmul, a, targets=[TARGET])
    assert result[0, 0] == 4 and local.error is None  # the graph still runs here
    line = integer_matmul.__code__.co_firstlineno + 1
    assert re.search(rf"graph \d+ \(inference\) cannot be compiled for tpu:v5e:2x2: aten\.mm\.default at \S+"
                     rf"test_compile_targets\.py:{line} \(dot of s64\[4,4\]\): UNIMPLEMENTED", tpu.error), tpu.error


def _module(text: str):
    from jax.extend.mlir import ir

    from tpucompile.lowering.context import mlir_context

    with mlir_context():
        return ir.Module.parse(text)


@needs_libtpu
def test_complex128_is_refused_before_libtpu_aborts_and_oversized_programs_do_not_fit():
    from tpucompile.runtime.targets.compile_only import compile_only_target
    from tpucompile.runtime.targets.cross_compile import TargetCompileError, compile_for

    target = compile_only_target(TARGET)
    c128 = _module('func.func @main(%a: tensor<4xcomplex<f64>>) -> tensor<4xcomplex<f64>> {\n'
                   '  %0 = stablehlo.sine %a : tensor<4xcomplex<f64>> loc("aten.sin.default"("m.py":7:0))\n'
                   '  return %0 : tensor<4xcomplex<f64>>\n}')
    with pytest.raises(TargetCompileError, match=r"graph 0 cannot be compiled for tpu:v5e:2x2: aten.sin.default "
                                                 r"at m.py:7 computes tensor<4xcomplex<f64>>; TPUs have no complex128"):
        compile_for(c128, target, "graph 0")
    n = 49152  # two 9 GiB temporaries: more than a v5e chip's 15.75 GiB
    big = _module(f"func.func @main(%a: tensor<{n}x{n}xf32>) -> tensor<f32> {{\n"
                  f"  %0 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, "
                  f"tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>\n"
                  f"  %1 = stablehlo.exponential %0 : tensor<{n}x{n}xf32>\n"
                  f"  %2 = stablehlo.dot_general %1, %0, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, "
                  f"tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>\n"
                  f"  %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
                  f"  %3 = stablehlo.reduce(%2 init: %z) applies stablehlo.add across dimensions = [0, 1] : "
                  f"(tensor<{n}x{n}xf32>, tensor<f32>) -> tensor<f32>\n"
                  f"  return %3 : tensor<f32>\n}}")
    with pytest.raises(TargetCompileError, match="graph 1 does not fit tpu:v5e:2x2: RESOURCE_EXHAUSTED") as oom:
        compile_for(big, target, "graph 1")
    assert oom.value.out_of_memory


@needs_libtpu
def test_a_sharded_program_compiles_across_the_slices_chips():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpucompile.runtime import compile_options
    from tpucompile.runtime.targets.compile_only import compile_only_target, spanning
    from tpucompile.runtime.targets.cross_compile import compile_for

    target = spanning(compile_only_target(TARGET), 4)
    assert [d.id for d in target.devices] == [0, 1, 2, 3] and target.describe()["device_count"] == 4
    assert compile_options(target).num_partitions == 4
    mesh = Mesh(np.array(target.devices).reshape(2, 2), ("data", "model"))
    lowered = jax.jit(lambda x, w: jnp.tanh(x @ w),
                      in_shardings=(NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model"))),
                      out_shardings=NamedSharding(mesh, P("data", "model"))).trace(
        jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 256), jnp.float32),
    ).lower(lowering_platforms=("tpu",))
    compiled = compile_for(_module(lowered.as_text()), target, "graph 0")
    optimized = compiled.executable.hlo_modules()[0].to_string()
    assert "num_partitions=4" in optimized and "f32[32,128]{1,0:T(8,128)}" in optimized  # one chip's shard
    assert compiled.report()["memory"]["argument"] == 4 * (32 * 128 + 128 * 128)


SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))
compiled = torch.compile(model, backend="tpucompile")
x = torch.randn(32, 64)
compiled(x).square().mean().backward()
with torch.no_grad():
    print("max diff", (compiled(x) - model(x)).abs().max().item())
"""


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return python_processes.run([sys.executable, "-m", "tpucompile", *args], capture_output=True, text=True, env=env,
                                timeout=300)


def _json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


@needs_libtpu
def test_warm_export_import_round_trip_and_ls_by_target(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_")}
    env["TPUCOMPILE_CACHE_DIR"] = str(tmp_path / "ci")
    cold = _cli("warm", "--json", "--target", TARGET, str(script), env=env)
    assert "TPU_ACCELERATOR_TYPE" not in cold.stderr and "TPU_WORKER_HOSTNAMES" not in cold.stderr
    warm = _json(cold)
    assert warm["graphs"] == 3 and warm["misses"] == 3  # forward, backward, inference, here on the CPU
    report = warm["targets"][TARGET]
    assert report["graphs"] == 3 and report["compiled"] == 3 and not report["failed"]
    again = _cli("warm", "--expect-all-hits", "--target", TARGET, str(script), env=env)
    assert again.returncode == 0 and f"{TARGET}: 3 graphs, 3 from the cache, 0 compiled" in again.stdout

    listing = _json(_cli("cache", "ls", "--json", "--target", TARGET, env=env))["entries"]
    assert {row["target"] for row in listing} == {TARGET}
    assert {row["key"] for row in listing if row["kind"] == "executable"} == set(report["keys"])
    assert f"executable  {TARGET}" in _cli("cache", "ls", env=env).stdout

    bundle = str(tmp_path / "tpu.bundle")
    assert _json(_cli("cache", "export", bundle, "--json", "--target", TARGET, env=env))["entries"] == len(listing)
    plain = _json(_cli("cache", "import", bundle, "--json", "--dir", str(tmp_path / "cpu-host"), env=env))
    assert not plain["imported"] and all(f"built for {TARGET}, not for this machine" in why
                                         for why in plain["skipped"].values())
    imported = _json(_cli("cache", "import", bundle, "--json", "--target", TARGET, "--dir",
                          str(tmp_path / "staging"), env=env))
    assert len(imported["imported"]) == len(listing) and not imported["skipped"]
    staged = _json(_cli("cache", "ls", "--json", "--dir", str(tmp_path / "staging"), env=env))["entries"]
    assert {(r["key"], r["target"]) for r in staged} == {(r["key"], r["target"]) for r in listing}


@needs_libtpu
@pytest.mark.parametrize("example", ["mlp.py", "mingpt.py"])
def test_dump_hlo_for_a_tpu_slice_reports_memory_per_chip(example, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_")}
    env["TPUCOMPILE_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "dump"
    result = _cli("dump-hlo", "--target", TARGET, os.path.join(ROOT, "examples", example), "--out", str(out), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TPU_ACCELERATOR_TYPE" not in result.stderr and "TPU_WORKER_HOSTNAMES" not in result.stderr
    lines = result.stdout.splitlines()
    title = lines.index(f"{TARGET}: memory per chip (of 15.75 GiB HBM)")
    assert lines[title + 1].split()[:7] == ["graph", "role", "arguments", "outputs", "temporaries", "code", "peak"]
    end = lines.index("", title)  # the table, then the step report
    rows = lines[title + 2:end]
    assert len(rows) == 3 and all(re.search(r" yes \((<0\.1|\d+\.\d)%\) ", row) for row in rows), rows
    assert lines[end + 1] == f"{TARGET}: one step per chip" and "fits:" in "\n".join(lines[end + 1:])
    for graph in range(3):
        stage = _cli("dump-hlo", "--out", str(out), "--target", TARGET, "--stage", "optimized", "--graph", str(graph),
                     env=env)
        assert stage.returncode == 0 and TILED.search(stage.stdout), stage.stderr
    missing = _cli("dump-hlo", "--out", str(out), "--target", "tpu:v6e:2x4", "--graph", "0", env=env)
    assert missing.returncode == cli.EXIT_NO_SUCH_GRAPH and "was not compiled for tpu:v6e:2x4" in missing.stderr


def test_dump_hlo_refuses_an_unknown_target_before_running_anything(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('ran')\n")
    result = _cli("dump-hlo", "--target", "tpu:v5e:2x2x2", str(script), "--out", str(tmp_path / "d"),
                  env=dict(os.environ))
    assert result.returncode == 1 and "ran" not in result.stderr
    assert "a v5e topology has 2 axes of chips (AxB); valid targets are" in result.stdout


@needs_libtpu
def test_dump_hlo_says_which_graph_does_not_compile_for_the_target(tmp_path):
    script = tmp_path / "counts.py"
    script.write_text("import torch\n\n\ndef f(a):\n    return a @ a\n\n\n"
                      "print(torch.compile(f, backend='tpucompile')(torch.ones(4, 4, dtype=torch.int64)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_")}
    env["TPUCOMPILE_CACHE_DIR"] = str(tmp_path / "cache")
    result = _cli("dump-hlo", "--target", TARGET, str(script), "--out", str(tmp_path / "d"), env=env)
    assert result.returncode == cli.EXIT_TARGET_FAILED, result.stderr[-2000:]
    assert re.search(r"^  graph 0: graph 0 \(inference\) cannot be compiled for tpu:v5e:2x2: aten\.mm\.default at "
                     r"\S+counts\.py:5 ", result.stdout, re.M), result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tpucompile dump-hlo: graph 0 (inference) does not compile for tpu:v5e:2x2: "), last


@needs_libtpu
def test_a_target_of_a_local_platform_compiles_by_loading():
    import dataclasses

    from tpucompile.runtime import get_target
    from tpucompile.runtime.targets.cross_compile import compile_for

    target = dataclasses.replace(get_target("cpu"), name="cpu", compile_only=True)
    module = _module("func.func @main(%a: tensor<8xf32>) -> tensor<8xf32> {\n"
                     "  %0 = stablehlo.tanh %a : tensor<8xf32>\n  return %0 : tensor<8xf32>\n}")
    compiled = compile_for(module, target, "graph 0")
    assert compiled.serialize() and compiled.report()["memory"]["argument"] == 32
