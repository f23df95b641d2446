"""``tpucompile dump-hlo`` and ``TPUCOMPILE_DUMP_DIR``, run as a user runs them: the CLI in a subprocess.

One dump of ``examples/mingpt.py`` (an inference graph, then a forward and a backward graph) is shared by the
tests that read it; the bad-input cases use tiny scripts of their own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir as jax_mlir

from tests import python_processes
from tpucompile import cli
from tpucompile.cache import cache_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINGPT = os.path.join(ROOT, "examples", "mingpt.py")
FILES = ["fx.txt", "aten_0_aot_autograd.txt", "aten_1_remove_noop_views.txt",
         "aten_2_sum_concatenations_by_part.txt", "aten_3_eliminate_dead_code.txt", "aten_4_lift_large_constants.txt",
         "aten.txt", "locations.txt", "stablehlo.mlir", "stablehlo.mlirbc", "hlo.txt", "hlo_optimized.txt",
         "compile_options.txt", "key.json", "info.json"]
LOC = re.compile(r'loc\("(?P<op>[^"]+)"\("(?P<file>[^"]+)":(?P<line>\d+):(?P<col>\d+)\)\)')


def run_cli(*args: str, env: dict[str, str], cwd: str | None = None) -> subprocess.CompletedProcess:
    return python_processes.run([sys.executable, "-m", "tpucompile", "dump-hlo", *args], capture_output=True, text=True,
                                env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of every run here: its own compile cache (so the first compiles miss), no dump dir."""
    environ = {k: v for k, v in os.environ.items() if k != "TPUCOMPILE_DUMP_DIR"}
    environ["TPUCOMPILE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return environ


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, env):
    """(dump directory, the completed ``dump-hlo examples/mingpt.py`` run)."""
    out = tmp_path_factory.mktemp("dump") / "mingpt"
    result = run_cli(MINGPT, "--out", str(out), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def _info(out, graph: int) -> dict:
    (folder,) = [p for p in out.iterdir() if p.name.startswith(f"{graph:03d}-")]
    return json.loads((folder / "info.json").read_text())


def _parse(text: str | bytes) -> ir.Module:
    context = jax_mlir.make_ir_context()
    with context:
        module = ir.Module.parse(text)
        assert module.operation.verify()
    return module


def _count_ops(operation) -> int:
    total = 0
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                name = op.operation.name
                total += name.startswith(("stablehlo.", "chlo.")) and name != "stablehlo.return"
                total += _count_ops(op.operation)
    return total


def _bytes_of(spec: str) -> int:
    """The bytes of a tensor described as ``f32[4,32]``."""
    dtype, shape = spec.rstrip("]").split("[")
    count = 1
    for size in filter(None, shape.split(",")):
        count *= int(size)
    return count * {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "i1": 1, "f64": 8}[dtype]


def _lines_of(path: str) -> list[str]:
    with open(path) as source:
        return source.read().splitlines()


def test_one_folder_per_graph_with_every_stage(dumped):
    out, _ = dumped
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == ["000-inference", "001-forward", "002-backward"]
    for name in folders:
        present = {p.name for p in (out / name).iterdir()}
        assert set(FILES) <= present, set(FILES) - present
        info = json.loads((out / name / "info.json").read_text())
        assert info["errors"] == {} and info["cache"] == "miss" and info["compile_ms"] > 0
        assert info["role"] == name.split("-")[1] and info["fallback_ops"] == []
        key = json.loads((out / name / "key.json").read_text())
        assert key["key"] == info["key"] == cache_key(key["components"])  # the components make the key
        assert key["components"]["compile_options"] in (out / name / "compile_options.txt").read_text()
        assert (out / name / "hlo.txt").read_text().startswith("HloModule")
        assert "is_scheduled=true" in (out / name / "hlo_optimized.txt").read_text()
        assert "class GraphModule" in (out / name / "fx.txt").read_text()
        assert "torch.ops.aten." in (out / name / "aten.txt").read_text()
        artifact = (out / name / "stablehlo.mlirbc").read_bytes()
        with jax_mlir.make_ir_context() as context:
            assert stablehlo.deserialize_portable_artifact(context, artifact).operation.verify()
    assert _info(out, 1)["inputs"][0] == "i64[4,32]" and _info(out, 0)["outputs"] == ["f32[4,32,256]"]
    saved = _info(out, 2)["saved_for_backward"]  # what the forward hands the backward, by kind
    backward = _info(out, 2)["inputs"]
    assert saved["activations"] > 0 and saved["arguments"] > 0
    assert saved["activations"] + saved["arguments"] <= sum(_bytes_of(spec) for spec in backward)
    assert _info(out, 0)["saved_for_backward"] is None and _info(out, 1)["saved_for_backward"] is None


def test_summary_table_on_stdout(dumped, env):
    out, result = dumped
    assert "inference: logits" not in result.stdout and "inference: logits" in result.stderr  # script → stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("3 graphs dumped to ")
    header = lines[1].split()
    assert header[:5] == ["graph", "role", "aten", "ops", "hlo"]
    for graph, line in enumerate(lines[2:]):
        info = _info(out, graph)
        cells = line.split()
        assert cells[:4] == [str(graph), info["role"], str(info["aten_ops"]), str(info["hlo_ops"])]
        assert cells[4] == f"{len(info['inputs'])}/{len(info['outputs'])}"
        assert info["key"][:12] in cells and "miss" in cells
        assert info["aten_ops"] == len((out / info["folder"] / "locations.txt").read_text().splitlines())
    assert len(lines) == 5
    again = run_cli("--out", str(out), "--json", env=env)  # read back without running anything
    assert [g["graph"] for g in json.loads(again.stdout)["graphs"]] == [0, 1, 2]


def test_stage_stablehlo_parses_verifies_and_points_into_the_example(dumped, env):
    out, _ = dumped
    result = run_cli("--out", str(out), "--stage", "stablehlo", "--graph", "0", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (out / "000-inference" / "stablehlo.mlir").read_text()
    module = _parse(result.stdout)
    assert _count_ops(module.operation) == _info(out, 0)["hlo_ops"]

    source = _lines_of(MINGPT)
    locations = [m.groupdict() for m in LOC.finditer(result.stdout)]
    assert len(locations) > 50
    assert {os.path.realpath(loc["file"]) for loc in locations} == {os.path.realpath(MINGPT)}
    assert all(1 <= int(loc["line"]) <= len(source) and source[int(loc["line"]) - 1].strip() for loc in locations)
    arange = [int(loc["line"]) for loc in locations if loc["op"] == "aten.arange.start_step"]
    assert arange and "torch.arange" in source[arange[0] - 1]
    for line in (out / "000-inference" / "locations.txt").read_text().splitlines():
        where = re.search(r"mingpt\.py:(\d+) in \S+: (.+)$", line)
        assert where, line
        assert source[int(where[1]) - 1].strip() == where[2].strip()


def test_each_stage_prints_alone(dumped, env):
    out, _ = dumped
    files = {"fx": ("fx.txt", "class GraphModule"), "aten": ("aten.txt", "torch.ops.aten.mm.default"),
             "hlo": ("hlo.txt", "dot("), "optimized": ("hlo_optimized.txt", "is_scheduled=true")}
    for stage, (name, marker) in files.items():
        result = run_cli("--out", str(out), "--stage", stage, "--graph", "2", env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout == (out / "002-backward" / name).read_text() and marker in result.stdout


def test_key_prints_the_cached_stablehlo_and_diff_compares_two(dumped, env):
    out, _ = dumped
    forward, inference = _info(out, 1)["key"], _info(out, 0)["key"]
    shown = run_cli("--key", forward[:10], "--out", str(out), env=env)
    assert shown.returncode == 0, shown.stderr
    printed = _parse(shown.stdout)
    stored = _parse((out / "001-forward" / "stablehlo.mlir").read_text())
    assert printed.operation.get_asm() == stored.operation.get_asm()  # equal, locations aside
    assert LOC.search(shown.stdout)

    diff = run_cli("--diff", inference[:10], forward[:10], "--out", str(out), env=env)
    assert diff.returncode == 0, diff.stderr
    lines = diff.stdout.splitlines()
    assert lines[0] == f"--- {inference[:16]}" and lines[1] == f"+++ {forward[:16]}" and lines[2].startswith("@@")
    assert not LOC.search(diff.stdout)  # keys ignore locations, and so does the diff
    same = run_cli("--diff", forward, forward[:12], "--out", str(out), env=env)
    assert same.returncode == 0 and "have the same StableHLO" in same.stdout


def test_dump_dir_variable_dumps_any_program(tmp_path, env):
    script = tmp_path / "tiny.py"
    script.write_text("import torch\n\n"
                      "f = torch.compile(lambda x: torch.sin(x) * 2, backend='tpucompile')\n"
                      "print(f(torch.ones(3)))\n")
    out = tmp_path / "dump"
    result = python_processes.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                                  env={**env, "TPUCOMPILE_DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert set(FILES) - {"fx_rewrite_attention.txt"} <= {p.name for p in (out / "000-inference").iterdir()}
    text = (out / "000-inference" / "stablehlo.mlir").read_text()
    assert {(m["op"], os.path.basename(m["file"]), m["line"]) for m in LOC.finditer(text)} == {
        ("aten.sin.default", "tiny.py", "3"), ("aten.mul.Tensor", "tiny.py", "3")}
    summary = run_cli(env={**env, "TPUCOMPILE_DUMP_DIR": str(out)})  # --out defaults to the variable
    assert summary.returncode == 0 and summary.stdout.startswith("1 graph dumped to ")


def _failure(result: subprocess.CompletedProcess, status: int, message: str) -> None:
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tpucompile dump-hlo: ") and message in last, last
    assert result.stdout == ""


def test_a_script_that_raises_keeps_its_dumps(tmp_path, env):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nimport torch\n\n"
                      "print('args', sys.argv[1:])\n"
                      "torch.compile(lambda x: x + 1, backend='tpucompile')(torch.ones(2))\n\n\n"
                      "def step():\n    raise RuntimeError('loss is nan\\nmore detail')\n\n\nstep()\n")
    out = tmp_path / "dump"
    result = run_cli(str(script), "--out", str(out), "--", "--steps", "2", env=env)
    _failure(result, cli.EXIT_SCRIPT_FAILED, "fails.py raised RuntimeError: loss is nan; 1 graph dumped")
    assert "args ['--steps', '2']" in result.stderr
    assert 'fails.py", line 12, in <module>' in result.stderr and "in step" in result.stderr
    assert "runpy" not in result.stderr
    assert (out / "000-inference" / "stablehlo.mlir").is_file()


def test_bad_inputs_each_have_a_message_and_status(tmp_path, env, dumped):
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import torch\n\nprint(torch.ones(2) + 1)\n")
    _failure(run_cli(str(tmp_path / "missing.py"), env=env), cli.EXIT_NO_SCRIPT, "no such script")
    _failure(run_cli(str(quiet), "--out", str(tmp_path / "d"), env=env), cli.EXIT_NOTHING_COMPILED,
             "compiled nothing")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _failure(run_cli(str(quiet), "--out", str(blocker / "dump"), env=env), cli.EXIT_OUT_NOT_WRITABLE,
             "cannot write the dump to")
    out, _ = dumped
    _failure(run_cli("--key", "abcdef12", "--out", str(out), env=env), cli.EXIT_UNKNOWN_KEY,
             "no cache entry or dumped graph has key abcdef12")
    _failure(run_cli("--graph", "9", "--out", str(out), env=env), cli.EXIT_NO_SUCH_GRAPH, "no graph 9")
    _failure(run_cli("--out", str(tmp_path / "empty"), env=env), cli.EXIT_NO_SUCH_GRAPH, "no dump in")
    statuses = {cli.EXIT_NO_SCRIPT, cli.EXIT_SCRIPT_FAILED, cli.EXIT_NOTHING_COMPILED, cli.EXIT_UNKNOWN_KEY,
                cli.EXIT_OUT_NOT_WRITABLE, cli.EXIT_NO_SUCH_GRAPH}
    assert len(statuses) == 6 and not statuses & {0, 1, 2}


def test_help_documents_it_with_an_example(env):
    result = run_cli("--help", env=env)
    assert result.returncode == 0
    for words in ("--out", "--stage", "--graph", "--key", "--diff", "TPUCOMPILE_DUMP_DIR", "examples:",
                  "tpucompile dump-hlo examples/mlp.py", "exit status:", "stablehlo.mlir", "hlo_optimized.txt"):
        assert words in result.stdout, words


def test_step_report_from_graph_reports():
    """The step report sums a step's graphs: bytes by use, the fit against the chip's HBM with the optimiser
    state resident during forward and backward, and the time from XLA's estimate, else the compiler's cycles,
    else the roofline, with the roofline figure beside it."""
    from tpucompile.debug.step_report import format_step_report, step_report

    def graph(name, role, uses, peak, flops, seconds, cycles=None, bytes_accessed=1e9):
        memory = {"argument": 0, "output": 0, "temp": 100, "generated_code": 0, "peak": peak}
        return {"name": name, "role": role, "uses": uses,
                "report": {"memory": memory, "flops": flops, "bytes_accessed": bytes_accessed,
                           "optimal_seconds": seconds, "estimated_cycles": cycles}}

    gib = 2**30
    graphs = [
        graph("graph 0 (forward)", "forward", {"parameters": 2 * gib, "inputs": 10}, 6 * gib, 1e12, -2.0, 1.75e7),
        graph("graph 0 (backward)", "backward", {"parameters": 2 * gib, "activations": 3 * gib,
                                                 "gradients_returned": 2 * gib}, 9 * gib, 2e12, 0.01),
        graph("graph 1 (inference)", "inference", {"parameters": 2 * gib, "gradients": 2 * gib,
                                                   "optimizer_state": 4 * gib}, 8 * gib, 1e10, None),
    ]
    report = step_report(graphs, "tpu:v5p:2x2x1")
    assert report["bytes_per_chip"] == {"parameters": 2 * gib, "gradients": 2 * gib, "optimizer_state": 4 * gib,
                                        "activations": 3 * gib, "inputs": 10, "temporaries": 100}
    assert report["peak_per_chip"] == 13 * gib  # the backward's peak and the resident optimiser state
    assert report["fits"] and report["margin_bytes"] == int(95.74 * gib) - 13 * gib
    # forward: no XLA estimate, 1.75e7 cycles at v5p's clock (459e12 / (8 x 128 x 128 x 2) = 1.751 GHz);
    # backward: XLA's 10 ms; the optimiser step: the roofline
    forward, step = 1.75e7 / (459e12 / (8 * 128 * 128 * 2)), max(1e10 / 459e12, 1e9 / 2765e9)
    assert abs(report["estimated_step_seconds"] - (forward + 0.01 + step)) < 1e-12
    assert report["estimated_by"] == ["cycles", "roofline", "xla"]
    assert abs(report["estimated_mfu"] - 3.01e12 / ((forward + 0.01 + step) * 459e12)) < 1e-9
    bound = max(1e12 / 459e12, 1e9 / 2765e9) + max(2e12 / 459e12, 1e9 / 2765e9) + step
    assert abs(report["roofline_step_seconds"] - bound) < 1e-12
    assert abs(report["roofline_mfu"] - 3.01e12 / (bound * 459e12)) < 1e-9
    # an XLA estimate faster than the program's flops at the chip's peak is not taken: the cycles are
    impossible = [dict(g, report=dict(g["report"], optimal_seconds=1e-3, estimated_cycles=3.5e7))
                  if g["role"] == "backward" else g for g in graphs]
    fallen_back = step_report(impossible, "tpu:v5p:2x2x1")
    backward = 3.5e7 / (459e12 / (8 * 128 * 128 * 2))
    assert abs(fallen_back["estimated_step_seconds"] - (forward + backward + step)) < 1e-12
    assert fallen_back["estimated_by"] == ["cycles", "roofline"]
    text = format_step_report(step_report(graphs, "tpu:v5e:2x2"))
    assert "fits: 13.00 GiB of 15.75 GiB HBM" in text and "step time (roofline)" in text
    small = step_report([dict(g, report=dict(g["report"], memory=dict(g["report"]["memory"], peak=20 * gib)))
                         for g in graphs], "tpu:v5e:2x2")
    assert small["fits"] is False and small["margin_bytes"] < 0
    assert "DOES NOT FIT" in format_step_report(small)
    # 20 GiB + 4 GiB of optimiser state, of which 11 GiB split over the data axis: twice the axis leaves
    # 13 + 5.5 GiB, four times 13 + 2.75 = 15.75 GiB, which fits
    assert small["suggestion"].startswith("needs 24.00 GiB per chip of 15.75 GiB (parameters 2.00 GiB, ")
    assert "a data axis 4x larger" in small["suggestion"] and "about 15.75 GiB" in small["suggestion"]
    assert report["suggestion"] is None


def test_progress_lines_on_a_terminal_only(monkeypatch):
    """warm and dump-hlo print a line per compiled graph to a terminal (TPU compiles of large graphs take
    minutes), and nothing under --json or into a pipe."""
    import argparse
    import io
    import types

    from tpucompile.cli.common import progress_lines

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    line = progress_lines(argparse.Namespace(json=False))
    event = types.SimpleNamespace(name="graph 0 (backward)", target="tpu:v5p:4x4x4", error=None, cache_hit=False,
                                  compile_seconds=61.25)
    line(event)
    line(types.SimpleNamespace(**{**vars(event), "cache_hit": True, "target": None}))
    lines = terminal.getvalue().splitlines()
    assert lines[0].startswith("tpucompile: 1: graph 0 (backward) for tpu:v5p:4x4x4: compiled in 61.2 s (")
    assert lines[1].startswith("tpucompile: 2: graph 0 (backward) for this machine: from the cache (")
    assert progress_lines(argparse.Namespace(json=True)) is None
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert progress_lines(argparse.Namespace(json=False)) is None
