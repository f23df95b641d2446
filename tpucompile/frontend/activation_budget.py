"""Choosing what a training graph's forward saves for its backward so that the step fits the chip.

AOTAutograd splits a joint forward-backward graph with a partition function; its ``activation_memory_budget``
trades saved activations for recomputation in the backward (1: save what the min-cut saves; 0: recompute
everything that can be). With the ``activation_memory_budget`` option at "auto", ``fitting_partition`` makes
that choice per graph: it partitions at 1, estimates the step's peak bytes per chip, and when that exceeds the
chip's HBM marks the values passed between the model's repeated blocks to be saved (``block_boundaries``) and
searches for the largest budget whose estimate fits. The choice travels with the forward and backward graphs
(``meta[BUDGET_KEY]``) into the step report.

In a graph with rolled layers the budget applies inside the loops' bodies, as ``jax.checkpoint`` on a scanned
layer does for a JAX user: PyTorch partitions one iteration's joint graph while AOTAutograd traces the loop
(with the budget set then), so each layer's backward recomputes its own values inside the reverse loop, and
the partition of the graph around the loops saves everything at 1. Applied outside instead, a budget below 1
recomputed the forward loop's stacked values in the backward before the reverse loop, every layer's at once,
which measured a higher peak and a slower step than saving them (a 405B-shaped plan: 81.4 against 77.7 GiB
per chip, 3.2 against 2.2 s). At "auto", a lower budget for the bodies therefore needs new traces:
``fit_loop_bodies`` probes budgets by bisection, each trace's partition only estimating, and traces once more
at the one it picked.

The estimate is a liveness walk over each ATen graph in its order: every value is held from the op that makes
it to its last reader, views hold nothing of their own, elementwise results read only nearby by elementwise
ops and reductions are fused away, a graph's inputs are held throughout, and what the forward reads but does
not save stays resident while the backward runs. Under a mesh each value counts its share per chip, the plan's
split followed through the graphs (``tensor_split``), and a rolled loop holds its stacked results from its start
and one iteration's working set while it runs. It follows the graph's order, not XLA's schedule: where a
partition recomputes a long chain (a residual stream from the embedding, which saving the blocks' boundaries
prevents), XLA keeps far more alive than the walk does, and ``FIT_FRACTION`` leaves room for the error
measured on partitions that do not; the compile's own report is the word on whether the step fits. It does
not see state compiled in other graphs (an optimiser's), which the step report adds from those graphs.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from tpucompile.config import Options
from tpucompile.contracts.input_uses import BUDGET_KEY
from tpucompile.contracts.loop_ops import body_of, is_loop, loop_parts
from tpucompile.contracts.target_names import GENERATIONS
from tpucompile.contracts.target_names import parse as parse_target
from tpucompile.frontend.block_boundaries import mark_block_boundaries
from tpucompile.frontend.tensor_split import (
    CONVERSIONS,
    Split,
    divisor,
    gathered_updates,
    traced_bytes,
    value_splits,
)
from tpucompile.passes.noop_views import is_view
from tpucompile.passes.rolled_loops import tidy_rolled_loops
from tpucompile.passes.saved_transposes import save_bases_of_transposes
from tpucompile.sharding.annotate import input_index

FIT_FRACTION = 0.85
"""The share of a chip's HBM a lowered budget's estimate may fill: the rest covers the estimate's error and the
runtime's own reserve. Measured against XLA's TPU compiler (v5e, 15.75 GiB), the estimate ran 5% over XLA's
peak on a stack of MLP blocks and 11% under it on a 0.86B decoder at 8 x 2048 tokens (13.2 GiB estimated,
14.6 GiB by XLA; at an estimate of 14.6 GiB XLA's backward did not fit). (The budget is lowered only when the
estimate at 1 exceeds the whole HBM: near the edge, a step XLA would take as it is must not pay for
recomputation.)"""

SEARCH_STEPS = 6
"""Bisection steps between 0 and 1 (the budget found within 1/64 of the largest that fits)."""

LOOP_SEARCH_STEPS = 3
"""Bisection steps for a loop body's budget (within 1/8): each is a whole new trace of the graph."""


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """The budget one training graph was partitioned with, and why."""

    budget: float
    chosen: bool
    """True when the budget was searched for (the option at "auto"); False when the option set it."""
    estimated_peak: int | None
    """The step's estimated peak bytes per chip at ``budget`` (None when nothing was estimated)."""
    hbm: int | None
    """The smallest HBM per chip among the targets (None: no target with a known HBM)."""
    peak_at_full_budget: int | None
    """The estimate at budget 1, when a lower budget was chosen."""
    saved_boundaries: int = 0
    """Values passed between the model's repeated blocks that the forward was made to save (``block_boundaries``),
    when a lower budget was searched for: 0 when none were marked."""
    in_loop_bodies: bool = False
    """True when the graph holds rolled layers: ``budget`` is the loops' bodies' (each layer's backward
    recomputes its own values in the reverse loop), and the partition around the loops saved all at 1."""

    @property
    def fits(self) -> bool | None:
        return None if self.hbm is None or self.estimated_peak is None else self.estimated_peak <= self.hbm

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fits": self.fits}


def target_hbm(config: Options) -> int | None:
    """The HBM one chip of the smallest-memory compile target offers a program; None without such targets."""
    sizes = [GENERATIONS[generation].hbm_bytes for name in config.targets
             if (generation := parse_target(name).generation) is not None]
    return min(sizes) if sizes else None


def _fits(peak: int, hbm: int) -> bool:
    return peak <= FIT_FRACTION * hbm


@dataclasses.dataclass(frozen=True)
class LoopBodyTrial:
    """One trace of a graph as ``fit_loop_bodies`` asks for it: the budget its loops' bodies are partitioned at
    (``traced_budget``), and whether its partition only estimates the peak (``LoopBodyEstimate``)."""

    budget: float = 1.0
    probe: bool = False
    peak_at_full_budget: int | None = None
    """The estimate with the bodies at 1, known once a search has begun."""


FIRST_TRIAL = LoopBodyTrial()
"""A graph's first trace: its loop bodies at the full budget (or the option's)."""


class LoopBodyEstimate(Exception):
    """Raised by the partition of a graph with rolled layers: its estimated step peak at the trial's loop body
    budget, for ``fit_loop_bodies`` to search with (a probe's, or the full budget's when it does not fit)."""

    def __init__(self, budget: float, peak: int, hbm: int) -> None:
        super().__init__(f"loop bodies at budget {budget}: estimated peak {peak} bytes of {hbm}")
        self.budget, self.peak, self.hbm = budget, peak, hbm


def traced_budget(config: Options, trial: LoopBodyTrial = FIRST_TRIAL) -> float:
    """The ``activation_memory_budget`` functorch setting a trace runs under: the one PyTorch's partition of
    each loop's body reads while AOTAutograd traces the loop (the option's, or the trial's at "auto"); the
    partition of the whole graph sets its own (``fitting_partition``)."""
    budget = config.activation_memory_budget
    return trial.budget if budget == "auto" else float(budget)


def fit_loop_bodies(trace: Callable[[LoopBodyTrial], Any]) -> Any:
    """``trace(trial)`` (a whole AOTAutograd trace and compile of one graph) at the loop bodies' full budget,
    or, when its partition finds the estimate over the HBM (``LoopBodyEstimate``), at the largest body budget
    whose estimate fits, found by bisection with probe traces, then 0; when none fits, at the budget of the
    smallest estimate (the step report then says it does not fit)."""
    try:
        return trace(FIRST_TRIAL)
    except LoopBodyEstimate as over:
        full, hbm = over.peak, over.hbm

    def probe(budget: float) -> int:
        try:
            trace(LoopBodyTrial(budget, probe=True, peak_at_full_budget=full))
        except LoopBodyEstimate as estimate:
            return estimate.peak
        raise AssertionError("a probe trace compiled its graph instead of estimating it")

    budget = _bisect(probe, full, hbm, LOOP_SEARCH_STEPS)
    return trace(LoopBodyTrial(budget, peak_at_full_budget=full))


def _bisect(estimate: Callable[[float], int], full: int, hbm: int, steps: int) -> float:
    """The largest budget below 1 whose ``estimate`` fits ``hbm``, found by bisection (fitting: look higher;
    not: lower) in ``steps`` steps, then 0; when none fits, the budget of the smallest estimate, the larger
    budget among equal ones (``full``: the estimate at 1, which does not fit). The estimate is not monotone near
    0: saving nothing makes the backward recompute every layer's activations at once."""
    tried = {1.0: full}
    low, high = 0.0, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        tried[middle] = estimate(middle)
        low, high = (middle, high) if _fits(tried[middle], hbm) else (low, middle)
    if low == 0.0:
        tried[0.0] = estimate(0.0)
    fitting = [budget for budget, peak in tried.items() if _fits(peak, hbm) and budget < 1.0]
    return max(fitting) if fitting else min(tried, key=lambda b: (tried[b], -b))


def fitting_partition(config: Options, trial: LoopBodyTrial = FIRST_TRIAL) -> Callable[..., Any]:
    """An AOTAutograd partition function for ``config``: the min-cut at the option's budget, or, with the option
    at "auto", at the largest budget whose estimated step peak fits the targets' HBM (1 when it fits as it is,
    or when there is no target to fit).
    A graph with rolled layers is split at 1 around its loops, whose bodies were partitioned at ``trial``'s
    budget (or the option's) during the trace; at "auto" it raises ``LoopBodyEstimate`` for a probe trial, and
    for the full budget when that does not fit (``fit_loop_bodies``)."""
    hbm = target_hbm(config)
    axis_sizes = dict(config.mesh.axes) if config.mesh is not None else {}
    splits = _input_splits(config)
    gradient_splits = _gradient_splits(config, splits)

    def partition(joint_module: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        tidy_rolled_loops(joint_module)
        def split(budget: float) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
            with torch._functorch.config.patch(activation_memory_budget=budget):
                forward, backward = min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
            return forward, backward, step_peak(forward, backward, axis_sizes, splits, gradient_splits)

        loops = any(is_loop(node) for node in joint_module.graph.nodes)
        if config.activation_memory_budget != "auto":
            budget = float(config.activation_memory_budget)
            forward, backward, peak = split(1.0 if loops else budget)
            choice = BudgetChoice(budget, False, peak, hbm, None, in_loop_bodies=loops)
        elif loops:
            forward, backward, peak = split(1.0)
            if hbm is not None and (trial.probe or (trial.peak_at_full_budget is None and peak > hbm)):
                raise LoopBodyEstimate(trial.budget, peak, hbm)  # a probe's estimate, or the search's start
            choice = BudgetChoice(trial.budget, True, peak, hbm, trial.peak_at_full_budget, in_loop_bodies=True)
        else:
            forward, backward, choice = _search(
                split, hbm, lambda: mark_block_boundaries(joint_module, kwargs["num_fwd_outputs"]))
        if config.saved_transposes_as_bases:
            save_bases_of_transposes(forward, backward, kwargs["num_fwd_outputs"], runtime_merges=(
                config.dynamic_mode != "exact" and config.bucket_saved_unmerged))
        forward.meta[BUDGET_KEY] = backward.meta[BUDGET_KEY] = choice.as_dict()
        return forward, backward

    return partition


def _search(split: Callable[[float], tuple[Any, Any, int]], hbm: int | None, mark_boundaries: Callable[[], int]
            ) -> tuple[Any, Any, BudgetChoice]:
    """The partition at the largest budget whose estimate fits ``hbm``: 1 when the estimate at 1 is within the
    chip (or there is no HBM to fit), else, with the values between repeated blocks marked to be saved
    (``mark_boundaries``), found by ``_bisect``; when none fits, the budget of the smallest estimate (the
    report then says it does not fit)."""
    forward, backward, full = split(1.0)
    if hbm is None or full <= hbm:  # within the estimate's error of fitting: left to XLA as it is
        return forward, backward, BudgetChoice(1.0, True, full, hbm, None)
    boundaries = mark_boundaries()
    tried = {1.0: (forward, backward, full)}

    def estimate(budget: float) -> int:
        tried[budget] = split(budget)
        return tried[budget][2]

    budget = _bisect(estimate, full, hbm, SEARCH_STEPS)
    forward, backward, peak = tried[budget]
    return forward, backward, BudgetChoice(budget, True, peak, hbm, full, boundaries if budget < 1 else 0)


def step_peak(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule,
              axis_sizes: Mapping[str, int] | None = None, input_splits: Sequence[Split | None] = (),
              gradient_splits: Sequence[Split | None] = ()) -> int:
    """Estimated peak bytes per chip of a forward and its backward: the larger of the forward's own peak and the
    backward's plus the forward inputs it does not read (held by the caller meanwhile: parameters, the batch).
    ``input_splits[i]``: the mesh axes (of sizes ``axis_sizes``) that split graph input i, which
    ``tensor_split`` follows to every value (whole without a plan); ``gradient_splits[i]``: how the backward
    returns the gradient of input i."""

    axis_sizes = axis_sizes or {}

    def input_split(node: torch.fx.Node) -> Split | None:
        index = input_index(node.name)
        return input_splits[index] if index is not None and index < len(input_splits) else None

    forward_splits = value_splits(forward, axis_sizes, input_split)
    forward_nodes = {node.name: node for node in forward.graph.nodes}
    backward_splits = value_splits(backward, axis_sizes, lambda node: input_split(node) if input_index(node.name)
                                   is not None else forward_splits.get(forward_nodes.get(node.name)), gradient_splits)
    splits = {**forward_splits, **backward_splits}
    # the forward's stacked parameters, which a backward reads under the same names
    weight_stacks = {node.name for node in forward.graph.nodes if _stacks_inputs(node)}

    def size(node: torch.fx.Node) -> int:
        own = traced_bytes(node.meta.get("val")) // divisor(splits.get(node), axis_sizes)
        return own + gathered_updates(node, splits, axis_sizes)

    def working_set(loop: torch.fx.Node) -> int:
        """One iteration of ``loop``: its inputs are slices of stacks and carries its graph holds already,
        except a layer's weights, which the iteration gathers across the axes that split them with the batch."""
        _, init, xs, _, _, _ = loop_parts(loop)
        body = body_of(loop)
        placeholders = [node for node in body.graph.nodes if node.op == "placeholder"]
        weights = {inner for inner, outer in zip(placeholders[len(init):], xs, strict=False)
                   if isinstance(outer, torch.fx.Node)
                   and (_stacks_inputs(outer) or (outer.op == "placeholder" and outer.name in weight_stacks))}
        batch_axes = frozenset().union(*(axes for node in placeholders if node not in weights
                                         for axes in splits.get(node, ())))

        def body_size(node: torch.fx.Node) -> int:
            if node.op != "placeholder":
                return size(node)
            if node not in weights:
                return 0
            gathered = tuple(axes - batch_axes for axes in splits.get(node, ()))
            return traced_bytes(node.meta.get("val")) // divisor(gathered, axis_sizes)

        return program_peak(body, body_size)

    read_by_backward = {n.name for n in backward.graph.nodes if n.op == "placeholder"}
    held = sum(size(n) for n in forward.graph.nodes if n.op == "placeholder" and n.name not in read_by_backward)
    return max(program_peak(forward, size, working_set), program_peak(backward, size, working_set) + held)


def _stacks_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node`` stacks graph inputs (a rolled loop's stacked parameters: a concatenation of each
    layer's value given a new leading axis)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default or not node.args[0]:
        return False
    return all(isinstance(part, torch.fx.Node) and is_view(part) and isinstance(part.args[0], torch.fx.Node)
               and part.args[0].op == "placeholder" for part in node.args[0])


def program_peak(gm: torch.fx.GraphModule, size: Callable[[torch.fx.Node], int],
                 working_set: Callable[[torch.fx.Node], int] | None = None) -> int:
    """The most bytes live at once while ``gm``'s ops run in order: inputs throughout, each other value from
    its op to its last reader (the output's values to the end), a view's bytes as its base's, and nothing for
    an elementwise result only elementwise ops and reductions read (fused away). A loop holds its results from
    its start, and while it runs, ``working_set(loop)``: one iteration's own values."""
    nodes = list(gm.graph.nodes)
    size = _unless_fused(size, _fused(nodes))
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        base = node.args[0] if (is_view(node) or _loop_result(node)) and node.args and isinstance(
            node.args[0], torch.fx.Node) else None
        owner[node] = owner[base] if base is not None else node
    last = {node: (len(nodes) if node.op in ("placeholder", "output") else index) for index, node in enumerate(nodes)}
    for index, node in enumerate(nodes):
        for value in node.all_input_nodes:
            root = owner[value]
            last[root] = max(last[root], len(nodes) if node.op == "output" else index)
    frees: dict[int, list[torch.fx.Node]] = collections.defaultdict(list)
    for node, index in last.items():
        if owner[node] is node:
            frees[index].append(node)

    def own_bytes(node: torch.fx.Node) -> int:
        return sum(size(user) for user in node.users if _loop_result(user)) if is_loop(node) else size(node)

    sizes = {node: own_bytes(node) for node in nodes if owner[node] is node}
    live = peak = 0
    for index, node in enumerate(nodes):
        if owner[node] is node:
            live += sizes[node]
        transient = working_set(node) if working_set is not None and is_loop(node) else 0
        peak = max(peak, live + transient)
        live -= sum(sizes[freed] for freed in frees[index])
    return peak


def _loop_result(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
            and is_loop(node.args[0]))


def _fused(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Elementwise results XLA would not store: every reader is an elementwise op or a reduction (which take
    elementwise producers into their own fusion) and reads it before the next op that does not fuse them
    (a product, a gather, a custom call); one read later, across such an op, keeps it in memory."""
    barrier_after: dict[torch.fx.Node, int] = {}
    next_barrier = len(nodes)
    for index in range(len(nodes) - 1, -1, -1):
        barrier_after[nodes[index]] = next_barrier
        node = nodes[index]
        if node.op == "call_function" and not (_fuses_producers(node) or is_view(node)
                                               or node.target is operator.getitem):
            next_barrier = index
    position = {node: index for index, node in enumerate(nodes)}
    return {node for node in nodes if _pointwise(node) and node.users
            and all(_fuses_producers(u) and position[u] <= barrier_after[node] for u in node.users)}


def _unless_fused(size: Callable[[torch.fx.Node], int], fused: set[torch.fx.Node]) -> Callable[[torch.fx.Node], int]:
    return lambda node: 0 if node in fused else size(node)


def _pointwise(node: torch.fx.Node) -> bool:
    """An elementwise op or a dtype conversion: XLA fuses chains of them into one loop."""
    return node.op == "call_function" and (node.target in CONVERSIONS
                                           or torch.Tag.pointwise in getattr(node.target, "tags", ()))


def _fuses_producers(node: torch.fx.Node) -> bool:
    """An op that takes elementwise producers into its own fusion (a loop, or a reduction's input), so a value
    only such ops read is never stored."""
    return _pointwise(node) or (node.op == "call_function"
                                and torch.Tag.reduction in getattr(node.target, "tags", ()))


def _input_splits(config: Options) -> tuple[Split | None, ...]:
    """For each graph input, the mesh axes that split each of its dimensions under the bound sharding plan."""
    plan = config.shard
    if plan is None or config.mesh is None or plan.bound is None:
        return ()
    return tuple(None if dims is None else tuple(frozenset(axes) for axes in dims) for dims in plan.bound)


def _gradient_splits(config: Options, input_splits: Sequence[Split | None]) -> tuple[Split | None, ...]:
    """How the backward returns each input's gradient (``sharding.annotate``): laid out as the input under a
    fully sharded plan, whole under another."""
    if not input_splits:
        return ()
    if config.shard.spread_axis(config.mesh) is not None:
        return tuple(input_splits)
    return tuple(None if split is None else (frozenset(),) * len(split) for split in input_splits)
