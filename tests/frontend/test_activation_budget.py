"""The activation-memory budget: below 1 the forward saves less for the backward (which recomputes more), the
gradients stay equal to eager, and the saved bytes each backward reports show it. At "auto" (the default) it is
chosen per graph: 1 while the step's estimated peak fits the targets' HBM, else the largest budget that fits;
checked against XLA's TPU compiler, which refuses the step at 1 and takes it at the budget chosen."""

from __future__ import annotations

import itertools

import pytest
import torch

from tpucompile import driver
from tpucompile.config import Options
from tpucompile.contracts.input_uses import BUDGET_KEY
from tpucompile.contracts.loop_ops import is_loop
from tpucompile.debug.step_report import format_step_report, step_report
from tpucompile.errors import OptionsError
from tpucompile.frontend import activation_budget


class _Block(torch.nn.Module):
    """A pre-LN MLP block: enough products and elementwise ops for the partition to have a choice."""

    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block(), _Block())


_RUNS = itertools.count()


def _train(budget: float | str, x: torch.Tensor, roll: bool = False) -> tuple[list[torch.Tensor], dict[str, int], dict]:
    """Gradients, the backward's saved bytes and the budget choice of one compiled training step on the CPU."""
    grads, saved, choice, _ = _train_with_events(budget, x, roll)
    return grads, saved, choice


def _train_with_events(budget: float | str, x: torch.Tensor, roll: bool = False
                       ) -> tuple[list[torch.Tensor], dict[str, int], dict, list]:
    torch._dynamo.reset()
    events: list = []
    remove = driver.add_observer(events.append)
    model = _model()
    try:
        # a plan key of its own per run (an option that changes nothing here): the tests change the HBM to fit
        # by patching, which the options, and so the in-process plans, do not see. The HBM to fit is a TPU
        # chip's, whose compiles keep their layers unrolled ("auto"), as here on the CPU
        options = {"activation_memory_budget": budget, "cache_mode": "off", "embed_constant_limit": 4096 + next(_RUNS),
                   "roll_layers": roll}
        compiled = torch.compile(model, backend="tpucompile", options=options)
        compiled(x).square().mean().backward()
    finally:
        remove()
    (saved,) = [e.saved_for_backward() for e in events if e.saved_for_backward() is not None]
    (choice,) = {str(e.graph.meta[BUDGET_KEY]): e.graph.meta[BUDGET_KEY] for e in events}.values()
    return [p.grad for p in model.parameters()], saved, choice, events


def _loops(events: list, role: str) -> int:
    """How many rolled loops the compiled graph of ``role`` ("forward" or "backward") runs."""
    (graph,) = [e.graph for e in events if e.name.endswith(f"({role})")]
    return sum(1 for node in graph.graph.nodes if is_loop(node))


def _assert_eager_gradients(grads: list[torch.Tensor], x: torch.Tensor) -> None:
    reference = _model()
    reference(x).square().mean().backward()
    for got, want in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-4, atol=1e-5)


def test_a_lower_budget_saves_fewer_activations_and_keeps_the_gradients():
    x = torch.randn(32, 64)
    reference = _model()
    reference(x).square().mean().backward()
    expected = [p.grad for p in reference.parameters()]
    grads, saved = {}, {}
    for budget in (1.0, 0.1):
        grads[budget], saved[budget], _ = _train(budget, x)
        for got, want in zip(grads[budget], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert saved[0.1]["activations"] < 0.5 * saved[1.0]["activations"], saved


def test_auto_keeps_the_full_budget_while_the_step_fits(monkeypatch):
    x = torch.randn(32, 64)
    _, saved_full, choice_full = _train(1.0, x)
    assert not choice_full["chosen"] and choice_full["budget"] == 1.0 and choice_full["hbm"] is None
    _, saved, choice = _train("auto", x)  # no target: nothing to fit
    assert choice == {**choice_full, "chosen": True} and saved == saved_full
    monkeypatch.setattr(activation_budget, "target_hbm", lambda config: 2 * choice_full["estimated_peak"])
    _, saved, choice = _train("auto", x)
    assert (choice["budget"], choice["fits"], choice["peak_at_full_budget"]) == (1.0, True, None)
    assert saved == saved_full


def test_auto_lowers_the_budget_until_the_estimate_fits_and_keeps_the_gradients(monkeypatch):
    x = torch.randn(512, 64)
    reference = _model()
    reference(x).square().mean().backward()
    _, saved_full, full = _train(1.0, x)
    _, _, least = min((_train(budget, x) for budget in (0.0, 0.5)), key=lambda run: run[2]["estimated_peak"])
    assert least["estimated_peak"] < full["estimated_peak"], (least, full)
    # an HBM the full budget's estimate exceeds, whose fitting share lies between a lower budget's and the full one's
    hbm = int(min(full["estimated_peak"] - 1,
                  (least["estimated_peak"] + full["estimated_peak"]) / 2 / activation_budget.FIT_FRACTION))
    assert least["estimated_peak"] < activation_budget.FIT_FRACTION * hbm, (least, full)
    monkeypatch.setattr(activation_budget, "target_hbm", lambda config: hbm)
    grads, saved, choice = _train("auto", x)
    assert 0.0 <= choice["budget"] < 1.0 and choice["chosen"] and choice["fits"], choice
    assert choice["saved_boundaries"] >= 2, choice  # the outputs of the first two of the three blocks at least
    assert choice["estimated_peak"] <= activation_budget.FIT_FRACTION * hbm < choice["peak_at_full_budget"]
    assert choice["peak_at_full_budget"] == full["estimated_peak"]
    assert saved["activations"] < saved_full["activations"], (saved, saved_full)
    for got, want in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-4, atol=1e-5)


def test_a_lower_budget_recomputes_inside_the_rolled_layers_loop():
    """With rolled layers the budget is the loop body's: each layer's backward recomputes its own values in the
    reverse loop, so the backward runs one loop (the reverse one), never the forward loop again, and the forward
    saves less the lower the budget."""
    x = torch.randn(512, 64)
    saved, peaks = {}, {}
    for budget in (1.0, 0.5, 0.0):
        grads, saved[budget], choice, events = _train_with_events(budget, x, roll=True)
        _assert_eager_gradients(grads, x)
        assert choice["in_loop_bodies"] and not choice["chosen"] and choice["budget"] == budget, choice
        assert (_loops(events, "forward"), _loops(events, "backward")) == (1, 1), budget
        peaks[budget] = choice["estimated_peak"]
    assert saved[0.0]["activations"] < saved[0.5]["activations"] < saved[1.0]["activations"], saved
    assert peaks[0.0] < peaks[0.5] < peaks[1.0], peaks


def test_auto_lowers_the_loop_bodies_budget_until_the_estimate_fits(monkeypatch):
    """At "auto", rolled layers whose estimate at 1 exceeds the HBM get the largest loop body budget that fits
    (new traces probe it), with the same gradients, and the estimate a set budget gives."""
    x = torch.randn(512, 64)
    _, saved_full, full = _train(1.0, x, roll=True)
    _, _, least = _train(0.0, x, roll=True)
    hbm = int((least["estimated_peak"] + full["estimated_peak"]) / 2 / activation_budget.FIT_FRACTION)
    assert least["estimated_peak"] < activation_budget.FIT_FRACTION * hbm < hbm < full["estimated_peak"]
    monkeypatch.setattr(activation_budget, "target_hbm", lambda config: hbm)
    traces = []
    fit = activation_budget.fit_loop_bodies
    monkeypatch.setattr("tpucompile.backend.fit_loop_bodies",
                        lambda trace: fit(lambda trial: traces.append(trial) or trace(trial)))
    grads, saved, choice, events = _train_with_events("auto", x, roll=True)
    _assert_eager_gradients(grads, x)
    assert 0.0 <= choice["budget"] < 1.0 and choice["chosen"] and choice["in_loop_bodies"] and choice["fits"], choice
    assert choice["peak_at_full_budget"] == full["estimated_peak"], (choice, full)
    assert saved["activations"] < saved_full["activations"]
    assert _loops(events, "backward") == 1
    # the first trace at 1, the probes, and the chosen budget's trace, which compiles
    assert traces[0].budget == 1.0 and not traces[0].probe and all(t.probe for t in traces[1:-1]), traces
    assert traces[-1].budget == choice["budget"] and not traces[-1].probe
    assert len(traces) <= 2 + activation_budget.LOOP_SEARCH_STEPS + 1, traces
    _, _, same = _train(choice["budget"], x, roll=True)
    assert same["estimated_peak"] == choice["estimated_peak"], (same, choice)
    # no body budget fits: the smallest estimate (at the largest budget that gives it), said not to fit
    monkeypatch.setattr(activation_budget, "target_hbm", lambda config: 1024)
    _, _, none_fits = _train("auto", x, roll=True)
    assert none_fits["fits"] is False and none_fits["budget"] < 1.0, none_fits
    # the smallest of the estimates tried, 0 among them (with a loop body's working set counted, the estimate is
    # not monotone in the budget: at 0 each iteration recomputes, and holds, more)
    assert none_fits["estimated_peak"] <= least["estimated_peak"]


def test_auto_takes_the_smallest_estimate_and_says_so_when_none_fits(monkeypatch):
    x = torch.randn(32, 64)
    least = min(_train(budget, x)[2]["estimated_peak"] for budget in (0.0, 1.0))
    monkeypatch.setattr(activation_budget, "target_hbm", lambda config: 1024)
    _, _, choice = _train("auto", x)
    assert choice["fits"] is False and choice["budget"] < 1.0 and choice["estimated_peak"] <= least, choice


def _compile_for_v5e(budget: float | str) -> list:
    """Compile events of a bf16 training step of 8 wide MLP blocks on 49152 tokens for one v5e chip (15.75 GiB),
    built on the meta device: its activations at budget 1 need more than the chip holds."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model = torch.nn.Sequential(*[_Block(2048, 8192) for _ in range(8)]).to(torch.bfloat16)
        x = torch.randn(49152, 2048, dtype=torch.bfloat16)
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        compiled = torch.compile(model, backend="tpucompile", options={
            "targets": ["tpu:v5e:1x1"], "cache_mode": "off", "activation_memory_budget": budget})
        compiled(x).float().square().mean().backward()
    finally:
        remove()
    return events


@pytest.mark.filterwarnings("ignore:.*does not fit")
def test_auto_fits_a_step_the_tpu_compiler_refuses_at_the_full_budget():
    refused = {e.name.rsplit(" ", 1)[1]: e for e in _compile_for_v5e(1.0)}
    assert refused["(backward)"].out_of_memory, refused
    events = _compile_for_v5e("auto")
    choice = events[0].graph.meta[BUDGET_KEY]
    assert choice["chosen"] and 0.0 <= choice["budget"] < 1.0 and choice["fits"], choice
    assert choice["peak_at_full_budget"] > activation_budget.FIT_FRACTION * choice["hbm"]
    for event in events:  # XLA's own figures: both programs compiled, within the chip
        assert event.error is None and not event.out_of_memory, event.error
        assert event.report["memory"]["peak"] <= choice["hbm"]
    graphs = [{"name": e.name, "role": e.name.split("(")[1].rstrip(")"), "uses": {}, "report": e.report,
               "activation_budget": e.graph.meta[BUDGET_KEY]} for e in events]
    text = format_step_report(step_report(graphs, "tpu:v5e:1x1"))
    graph = events[0].name.split(" (")[0]
    assert f"activation budget of {graph}: {choice['budget']:.3g}, chosen: at 1 the step's estimated peak" in text
    assert f"the {choice['saved_boundaries']} values passed between repeated blocks are saved" in text
    assert "fits" in text.splitlines()[7], text


def test_the_budget_is_checked():
    assert Options.from_sources({}).activation_memory_budget == "auto"
    assert Options.from_sources({}, {"TPUCOMPILE_ACTIVATION_MEMORY_BUDGET": "auto"}).activation_memory_budget == "auto"
    assert Options.from_sources({"activation_memory_budget": 0.5}).activation_memory_budget == 0.5
    assert Options.from_sources({}, {"TPUCOMPILE_ACTIVATION_MEMORY_BUDGET": "0.25"}).activation_memory_budget == 0.25
    for bad in (1.5, -0.1, "half", True, None):
        with pytest.raises(OptionsError, match="activation_memory_budget"):
            Options.from_sources({"activation_memory_budget": bad})
    with pytest.raises(OptionsError, match="not a number"):
        Options.from_sources({}, {"TPUCOMPILE_ACTIVATION_MEMORY_BUDGET": "half"})
