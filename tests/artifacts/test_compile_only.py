"""Compile-only runs: every graph of a step compiled for a TPU target and stored, nothing compiled for or run
on this machine, outputs with the right shapes and dtypes (``meta`` for a model that holds no weights)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tpucompile import driver
from tpucompile.cache import PersistentCache
from tpucompile.config import Options
from tpucompile.debug.step_report import format_step_report, step_report
from tpucompile.debug.uses import graph_uses
from tpucompile.driver import executable_assembly
from tpucompile.errors import OptionsError, UnsupportedOpError

TARGET = "tpu:v5e:1x1"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


def _events() -> tuple[list, callable]:
    events: list = []
    return events, driver.add_observer(events.append)


@needs_libtpu
def test_a_meta_model_trains_through_compile_only_and_fills_the_cache(tmp_path):
    """A model built on the meta device: forward, backward and an optimiser step all compile for the target
    (stored under the target's keys), nothing is compiled for this machine, and gradients are meta tensors
    shaped like the parameters."""
    with torch.device("meta"):
        net = _Net()
    x, labels = torch.randn(8, 16, device="meta"), torch.randint(0, 10, (8,), device="meta")
    options = {"targets": [TARGET], "cache_dir": str(tmp_path)}
    events, remove = _events()
    try:
        out = torch.compile(net, backend="tpucompile", options=options)(x)
        assert out.is_meta and out.shape == (8, 10) and out.dtype == torch.float32
        F.cross_entropy(out, labels).backward()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        torch.compile(optimizer.step, backend="tpucompile", options=options)()
    finally:
        remove()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and parameter.grad.is_meta and parameter.grad.shape == parameter.shape, name
    assert events and all(e.target == TARGET and e.error is None for e in events), [(e.name, e.target) for e in events]
    roles = {e.name.rsplit("(", 1)[-1].rstrip(")") for e in events}
    assert {"forward", "backward"} <= roles and len(events) >= 3, roles
    stored = PersistentCache(tmp_path)
    assert all(stored.get(e.key) is not None for e in events), "an executable for the target was not stored"
    assert all(e.report["memory"]["peak"] > 0 and e.report["flops"] > 0 for e in events)


@needs_libtpu
def test_compile_only_on_real_tensors_gives_outputs_of_the_right_shape_on_their_device():
    net = _Net()
    events, remove = _events()
    try:
        options = {"targets": [TARGET], "compile_only": True, "cache_mode": "off"}
        out = torch.compile(net, backend="tpucompile", options=options)(torch.randn(4, 16))
    finally:
        remove()
    assert out.device.type == "cpu" and out.shape == (4, 10)
    assert [e.target for e in events] == [TARGET]


def test_meta_inputs_without_targets_and_compile_only_without_targets_are_refused():
    with torch.device("meta"):
        net = _Net()
    with pytest.raises(Exception, match=r"is a meta tensor, which holds no values to run on.*targets"):
        torch.compile(net, backend="tpucompile")(torch.randn(2, 16, device="meta"))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="compile_only compiles for targets only"):
        torch.compile(_Net(), backend="tpucompile", options={"compile_only": True})(torch.randn(2, 16))


@needs_libtpu
def test_each_graph_compiled_for_a_target_hands_its_freed_memory_back(monkeypatch, tmp_path):
    """After every target compile (not after a cache hit), the heap's free pages go back to the system, so
    that the next graph's compile does not start from what the last one left."""
    released: list[str] = []
    monkeypatch.setattr(executable_assembly, "release_free_memory", lambda: released.append("released") or True)
    with torch.device("meta"):
        net = _Net()
    options = {"targets": [TARGET], "compile_only": True, "cache_dir": str(tmp_path)}
    events, remove = _events()
    try:
        torch.compile(net, backend="tpucompile", options=options)(torch.randn(8, 16, device="meta")).sum().backward()
        assert len(events) == 2 and len(released) == 2, (len(events), released)  # forward and backward compiled
        torch._dynamo.reset()
        torch.compile(net, backend="tpucompile", options=options)(torch.randn(8, 16, device="meta")).sum().backward()
    finally:
        remove()
    assert len(events) == 4 and all(e.cache_hit for e in events[2:]), [e.cache_hit for e in events]
    assert len(released) == 2, released  # nothing compiled the second time: nothing to give back


@torch.library.custom_op("tpucompile_test::positives", mutates_args=())
def _positives(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]


@_positives.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())  # a size only the values decide


class _Routed(torch.nn.Module):
    """Calls an op with no lowering whose fake implementation works but whose meta one cannot (its result
    size depends on the values), like a mixture-of-experts router's token selection."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        return y + _positives(y).sum()  # the line the error must name


@needs_libtpu
def test_an_op_that_cannot_run_on_meta_tensors_is_named_with_its_source_line():
    """Dynamo hands the op over inside a graph; it runs in eager PyTorch between compiled regions, where a
    meta tensor cannot give it values: the error names the op and the model's line, not the graph's code."""
    with torch.device("meta"):
        net = _Routed()
    line = _Routed.forward.__code__.co_firstlineno + 2
    options = {"targets": [TARGET], "compile_only": True, "cache_mode": "off", "fallback": "eager"}
    with (torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad(),
          pytest.raises(UnsupportedOpError) as raised):
        torch.compile(net, backend="tpucompile", options=options)(torch.randn(4, 16, device="meta"))
    message = str(raised.value)
    assert "tpucompile_test.positives" in message and "cannot run on the meta tensors" in message, message
    assert f"test_compile_only.py:{line} in forward" in message, message


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) + torch.bincount(x.long().flatten(), minlength=16)[:16]


@needs_libtpu
def test_an_op_dynamo_runs_outside_the_graphs_on_meta_tensors_keeps_torch_s_error_and_the_user_s_frame():
    """``bincount`` has no meta kernel, so Dynamo breaks the graph there and calls it on the meta tensors
    itself: the error is PyTorch's, naming the op, raised from the model's own line (tpucompile compiled
    the graph before it and does not hide it)."""
    with torch.device("meta"):
        net = _Counted()
    options = {"targets": [TARGET], "compile_only": True, "cache_mode": "off"}
    with pytest.raises(NotImplementedError, match="aten::bincount") as raised:
        torch.compile(net, backend="tpucompile", options=options)(torch.randn(4, 16, device="meta"))
    frames = [f for f in raised.traceback if f.path == pathlib.Path(__file__)]
    forward_body = _Counted.forward.__code__.co_firstlineno + 1  # the line after the def (1-based)
    assert frames[-1].lineno + 1 == forward_body, frames[-1]  # pytest's line numbers are 0-based


def test_compile_only_option_and_environment_variable():
    assert Options.from_sources(environ={"TPUCOMPILE_COMPILE_ONLY": "1"}).compile_only is True
    assert Options().compile_only is False
    with pytest.raises(OptionsError, match="must be a bool"):
        Options.from_sources({"compile_only": "yes"})


class _LossNet(_Net):
    """The loss inside the compiled module, as training code usually has it."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(x), labels)


def _target_keys(device: str, options: dict) -> dict[str, str]:
    """Forward, backward and AdamW step compiled with ``options`` on weights made on ``device``: the key of
    each graph's executable for the compile-only target, by graph role."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        net = _LossNet()
    x, labels = torch.randn(8, 16, device=device), torch.randint(0, 10, (8,), device=device)
    events, remove = _events()
    try:
        torch.compile(net, backend="tpucompile", options=options)(x, labels).backward()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        torch.compile(optimizer.step, backend="tpucompile", options=options)()
    finally:
        remove()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and parameter.grad.device.type == device, name
    found = {}
    for event in events:
        if event.target == TARGET:
            assert event.error is None, event.error
            found[event.name.split(" ", 2)[-1] + f" #{event.name.split(' ')[1]}"] = event.key
    return found


@needs_libtpu
def test_compile_only_on_meta_weights_fills_the_keys_a_real_run_looks_up(tmp_path):
    """Pre-warming from a CPU with weights that never exist writes exactly the entries a run with real weights
    and the same targets looks up: the same key for every graph (forward with the loss inside, backward, the
    optimiser step); weights never enter a key."""
    meta = _target_keys("meta", {"targets": [TARGET], "cache_dir": str(tmp_path / "meta")})
    real = _target_keys("cpu", {"targets": [TARGET], "cache_dir": str(tmp_path / "real")})
    roles = sorted(name.split(" #")[0] for name in meta)
    assert roles == ["(backward)", "(forward)", "(inference)"], roles  # the last: AdamW's step
    assert list(meta.values()) == list(real.values())
    stored = PersistentCache(tmp_path / "meta")
    assert all(stored.get(key) is not None for key in meta.values())


@needs_libtpu
def test_a_fully_sharded_step_compiles_for_a_slice_larger_than_this_machine(tmp_path):
    """FSDP over the 8 chips of a v5e slice, from meta weights on a machine with one CPU device: every graph
    compiles for the slice, and each chip holds an eighth of the weights."""
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    options = {"targets": ["tpu:v5e:2x4"], "mesh": {"data": 8}, "shard": "fsdp", "cache_dir": str(tmp_path)}
    events, remove = _events()
    try:
        torch.compile(net, backend="tpucompile", options=options)(torch.randn(64, 512, device="meta")).sum().backward()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        torch.compile(optimizer.step, backend="tpucompile", options=options)()
    finally:
        remove()
    assert all(p.grad is not None and p.grad.is_meta for p in net.parameters())
    assert [e.error for e in events] == [None, None, None] and all(e.target == "tpu:v5e:2x4" for e in events)
    weights = sum(p.numel() * 4 for p in net.parameters())  # 8.4 MB of float32
    forward, backward, step = (e.report["memory"] for e in events)
    assert forward["argument"] < weights / 6  # an eighth of the weights (and of the batch), with some padding
    assert step["argument"] < 4 * weights / 6  # parameters, gradients and two AdamW moments, split 8 ways
    assert backward["output"] < weights / 6  # gradients reduce-scattered, not all-reduced
    graphs = [{"name": e.name, "role": e.name.rsplit("(", 1)[-1].rstrip(")"), "uses": graph_uses(e.graph),
               "report": e.report} for e in events]
    step = step_report(graphs, "tpu:v5e:2x4")
    per_chip = step["bytes_per_chip"]
    assert per_chip["parameters"] == per_chip["gradients"] == weights // 8  # counted from the shardings: exact
    assert per_chip["optimizer_state"] == 2 * weights // 8 + 4 * 4  # AdamW's two moments, its 4 step counts
    assert per_chip["activations"] > 0 and per_chip["inputs"] == 64 * 512 * 4 // 8
    assert step["fits"] and step["margin_bytes"] == step["hbm_per_chip"] - step["peak_per_chip"]
    assert step["peak_per_chip"] >= max(r["memory"]["peak"] for r in step["graphs"])
    assert step["estimated_step_seconds"] > 0 and 0 < step["estimated_mfu"] <= 1
    text = format_step_report(step)
    assert "parameters" in text and "fits:" in text and "step time (estimated)" in text
    with pytest.raises(Exception, match="partitioned over 16 devices, but tpu:v5e:2x4 has 8"):
        torch._dynamo.reset()
        torch.compile(net, backend="tpucompile", options={**options, "mesh": {"data": 16}})(
            torch.randn(64, 512, device="meta"))


@needs_libtpu
def test_a_compile_only_run_is_dumped_with_its_step_report(tmp_path):
    """dump-hlo of a meta model: every graph gets its folder although nothing compiled for this machine, with
    its bytes per chip by use, and the summary ends with the target's step report."""
    from tpucompile.debug import reader, recorder
    from tpucompile.debug.report import format_summary, step_reports

    with torch.device("meta"):
        net = _LossNet()
    recorder.start(tmp_path / "dump")
    try:
        options = {"targets": [TARGET], "cache_mode": "off"}
        torch.compile(net, backend="tpucompile", options=options)(
            torch.randn(8, 16, device="meta"), torch.randint(0, 10, (8,), device="meta")).backward()
    finally:
        recorder.stop()
    infos = reader.read_dump(tmp_path / "dump")
    assert [info["role"] for info in infos] == ["forward", "backward"]
    assert all(TARGET in info["targets"] and info["uses_per_chip"]["parameters"] > 0 for info in infos)
    weights = sum(p.numel() * 4 for p in net.parameters())
    report = step_reports(infos)[TARGET]
    assert report["bytes_per_chip"]["parameters"] == weights and report["fits"]
    (graph,) = report["activation_budgets"]
    assert report["activation_budgets"][graph]["budget"] == 1.0 and report["activation_budgets"][graph]["chosen"]
    summary = format_summary(infos)
    assert f"{TARGET}: one step per chip" in summary
    assert f"activation budget of {graph}: 1, chosen: the step's estimated peak" in summary, summary


def test_a_rolled_step_counts_its_loop_s_flops_per_iteration(tmp_path):
    """XLA's cost analysis counts a loop's body once: the compile report adds the later iterations' products,
    so a rolled step's flops match the unrolled step's, and the step report gives no roofline from bytes that
    still count the body once."""
    from tpucompile.debug import reader, recorder
    from tpucompile.debug.report import step_reports

    flops = {}
    for roll in (True, False):
        torch._dynamo.reset()
        with torch.device("meta"):
            net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                                            torch.nn.Linear(512, 256)) for _ in range(6)])
        events, remove = _events()
        recorder.start(tmp_path / f"dump-{roll}")
        try:
            out = torch.compile(net, backend="tpucompile", options={
                "targets": [TARGET], "cache_mode": "off", "roll_layers": roll})(
                torch.randn(64, 256, device="meta", requires_grad=True))  # so both backwards make its gradient
            out.sum().backward()
        finally:
            recorder.stop()
            remove()
        flops[roll] = {e.name.rsplit("(", 1)[-1]: e.report["flops"] for e in events}
        assert any(e.report.get("loop_flops_added") for e in events) == roll
        report = step_reports(reader.read_dump(tmp_path / f"dump-{roll}"))[TARGET]
        assert report["rolled_loops"] == roll and (report["roofline_step_seconds"] is None) == roll
    for role, unrolled in flops[False].items():
        assert abs(flops[True][role] / unrolled - 1) <= 0.02, (role, flops)
