"""One executable per bucket of sizes for graphs with symbolic sizes.

Where the per-size path (``specialize``) compiles every new size, a bucketed graph rounds each size symbol up
to its bucket (the next power of two from ``bucket_minimum``, or the smallest of the ``buckets`` option that
holds it), compiles once per bucket a program that takes the actual sizes as arguments
(``lowering.dynamic_sizes``), pads each runtime-sized input with zeros at the end of its dimensions, and cuts
each result back to its actual sizes. A size above the largest listed bucket gets an executable of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from tpucompile.contracts.saved_handoff import HandoffEnd, is_saved_activation
from tpucompile.contracts.size_expressions import (
    SIZE_DTYPE,
    evaluate,
    read_symbols,
    runtime_size_assertion,
    runtime_symbols,
    shape_at,
    symbol_sources,
    symbolic_dims,
)
from tpucompile.errors import UnsupportedOpError
from tpucompile.metrics import compile_stats as stats
from tpucompile.metrics import memory_accounting
from tpucompile.runtime import host_copies, padded_results
from tpucompile.runtime.executable import GraphExecutable
from tpucompile.runtime.input_views import input_views, replace_views
from tpucompile.runtime.resident import shares_host_memory
from tpucompile.runtime.specialize import keep_bounded
from tpucompile.runtime.staged_inputs import StagedInput
from tpucompile.runtime.transfer import to_tensor

log = logging.getLogger("tpucompile")

Bucket = tuple[int, ...]


def bucket_size(value: int, sizes: Sequence[int], minimum: int) -> int:
    """The bucket ``value`` is padded to: the smallest of ``sizes`` that holds it (``value`` itself past the
    largest), or with no ``sizes`` the next power of two, at least ``minimum``."""
    if sizes:
        return next((size for size in sorted(sizes) if size >= value), value)
    bucket = max(1, minimum)
    while bucket < value:
        bucket *= 2
    return bucket


_SIZE_SOURCE = re.compile(r"^L\['([^']+)'\]\.size\(\)\[(\d+)\]$")


def input_dims(symbol: sympy.Symbol, metas: Sequence[Any]) -> list[tuple[str, int]]:
    """(argument name, dimension) of each input dimension of the compiled function that Dynamo made
    ``symbol`` (from the shape environment's sources, ``L['input_ids'].size()[1]``)."""
    for meta in metas:
        for size in getattr(meta, "shape", ()):
            if isinstance(size, torch.SymInt):
                env = size.node.shape_env
                found = []
                for source in env.var_to_sources.get(symbol, []):
                    name = source.name if isinstance(source.name, str) else source.name()
                    match = _SIZE_SOURCE.match(name)
                    if match:
                        found.append((match[1], int(match[2])))
                return found
    return []


def sizes_per_symbol(symbols: Sequence[sympy.Symbol], metas: Sequence[Any],
                     buckets: Sequence[Any]) -> dict[sympy.Symbol, tuple[int, ...]]:
    """The bucket sizes of each symbol: the ``buckets`` list for all, or from its per-input dict form (keyed by
    argument name, or ``name:dim``), the entry of an input dimension the symbol is the size of (none: powers of
    two)."""
    if not buckets or isinstance(buckets[0], int):
        return {symbol: tuple(buckets) for symbol in symbols}
    named = dict(buckets)
    chosen = {}
    for symbol in symbols:
        sizes: tuple[int, ...] = ()
        for name, dim in input_dims(symbol, metas):
            sizes = named.get(f"{name}:{dim}") or named.get(name) or ()
            if sizes:
                break
        chosen[symbol] = sizes
    return chosen


class BucketedGraph:
    """A boxed callable that pads each call to its bucket and runs the executable built for that bucket."""

    def __init__(
        self,
        name: str,
        gm: torch.fx.GraphModule,
        build: Callable[[dict[sympy.Symbol, int], frozenset[sympy.Symbol], dict[int, tuple[int, ...]]],
                        Callable[[list[Any]], list[Any]]],
        constants: Sequence[torch.Tensor],
        bucket_sizes: Sequence[Any],
        bucket_minimum: int,
        max_entries: int,
        handoff: HandoffEnd | None = None,
        stage_inputs: bool = True,
        reuse_padded_results: bool = True,
    ) -> None:
        self._boxed_call = True  # AOTAutograd passes the arguments as one list
        self.name = name
        self._build = build
        self._constants = list(constants)
        self._minimum = bucket_minimum
        self._max_entries = max(1, max_entries)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._metas = [n.meta.get("val") for n in placeholders]
        self.symbols = sorted(runtime_symbols(self._metas), key=str)
        self._sizes = sizes_per_symbol(self.symbols, self._metas, bucket_sizes)
        runtime = frozenset(self.symbols)
        backward = handoff is not None and handoff.role == "backward"
        saved = frozenset(position for position, node in enumerate(placeholders) if backward
                          and isinstance(node.meta.get("val"), torch.Tensor) and is_saved_activation(node.name))
        self._sources = symbol_sources(self._metas, runtime, last=saved)
        self._may_arrive_padded = frozenset()
        """Arguments that may come padded to the bucket: a bucketed backward's saved values, once it reads no
        size from them (``contracts/saved_handoff``)."""
        if saved and not {position for position, _ in self._sources.values()} & saved:
            self._may_arrive_padded = saved
            handoff.handoff.backward_takes_padded = True
        self._handoff = handoff.handoff if handoff is not None and handoff.role == "forward" else None
        self._padded = [(position, symbolic_dims(meta, runtime)) for position, meta in enumerate(self._metas)
                        if isinstance(meta, torch.Tensor) and symbolic_dims(meta, runtime)]
        self._outputs_rules = [self._output_rule(out, placeholders, runtime) for out in _graph_outputs(gm)]
        self._result_slots = ([padded_results.ResultSlot() for _ in self._outputs_rules] if reuse_padded_results
                              else None)
        """Per output, whether its cuts come back as inputs (``padded_results``); None: never reused."""
        self._headroom: dict[int, tuple[int, ...]] = {}
        """Per runtime-sized argument that a result of this graph extends, how far past its bucket (per
        dimension) the program takes it: that result's padding (``padded_results.growing_arguments``)."""
        if reuse_padded_results:
            self._headroom, extending = padded_results.growing_arguments(placeholders, _graph_outputs(gm), runtime)
            for index in extending:
                self._result_slots[index].always_noted = True
        self._views = input_views(gm)
        self._assertions = [found for node in gm.graph.nodes
                            if (found := runtime_size_assertion(node, runtime)) is not None]
        """Size assertions on runtime symbols (``u1 <= 24``), which the program's lowering leaves to the call."""
        self._entries: collections.OrderedDict[Bucket, _BucketEntry] = collections.OrderedDict()
        self._calls: dict[tuple[Any, ...], _Call] = {}
        """Per set of argument sizes seen, what a call with them runs (``_prepare``)."""
        self._key_tensors = [position for position, _ in self._padded]
        self._key_sizes = sorted({position for position, dim in self._sources.values() if dim is None})
        self._stage = stage_inputs
        self._last: Bucket | None = None
        self.recompiles: list[str] = []
        """The reason of every compile after the first, in order."""
        _LIVE.add(self)

    @staticmethod
    def readable(metas: Sequence[Any]) -> bool:
        """Whether every size symbol of ``metas`` can be read from a call's arguments."""
        symbols = runtime_symbols(metas)
        return set(symbol_sources(metas, symbols)) == set(symbols)

    def _output_rule(self, out: Any, placeholders: list[torch.fx.Node], runtime: frozenset) -> tuple[str, Any]:
        if isinstance(out, torch.fx.Node) and out.op == "placeholder":
            return "input", placeholders.index(out)
        val = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
        if isinstance(val, torch.Tensor):
            return "tensor", symbolic_dims(val, runtime)
        if isinstance(val, torch.SymInt):
            return "size", sympy.sympify(val.node.expr)
        return "as-is", None

    def bucket_of(self, values: dict[sympy.Symbol, int]) -> Bucket:
        return tuple(bucket_size(values[s], self._sizes[s], self._minimum) for s in self.symbols)

    def __call__(self, args: list[Any]) -> list[Any]:
        full = [*args, *self._constants]
        key = (*(full[p].shape for p in self._key_tensors), *(full[p] for p in self._key_sizes))
        call = self._calls.get(key)
        if call is None:
            call = self._prepare(full, key)
        else:
            self._hit(call.bucket)
        entry = call.entry
        padded = list(full)
        held = []
        reuse = entry.direct and self._result_slots is not None
        taken_over = set()
        """Positions given a buffer of the runtime's own that the program takes over."""
        try:
            for position, shape, staged in entry.pads:
                donated = position in entry.donated
                buffer = self._padded_result(full[position], shape, donated) if reuse else None
                if buffer is not None:  # a result of an earlier call, cut: the buffer it was cut from
                    padded[position] = buffer
                    if donated:
                        taken_over.add(position)
                elif staged is not None and staged.take(full[position]):
                    held.append(staged)
                    padded[position] = staged.tensor
                else:
                    padded[position] = host_copies.pad(full[position], shape)
            if entry.direct:
                # hand device buffers over only when each donated one is the runtime's own (a tensor is copied)
                donate = bool(taken_over) and all(isinstance(padded[p], torch.Tensor) or p in taken_over
                                                  for p in entry.donated)
                results = entry.runner.execute([*padded, *call.sizes], donate)
                if entry.spread is not None:  # outputs that are sizes or arguments: no result of their own
                    results = [None if index is None else results[index] for index in entry.spread]
            else:
                results = entry.runner([*padded, *call.sizes])
        finally:
            for staged in held:
                staged.release()
        outputs = self._outputs(call, results, full)
        return replace_views(outputs, self._views, full, call.values) if self._views else outputs

    def _outputs(self, call: _Call, results: Sequence[Any], args: list[Any]) -> list[Any]:
        """The call's outputs from the program's results: each runtime-sized one cut to its actual sizes,
        but a forward's saved values left padded for a backward that takes them so."""
        cuts = call.cuts
        if cuts is None:
            cuts = call.cuts = [self._cut_shape(result, rule, call.values)
                                for result, rule in zip(results, self._outputs_rules, strict=True)]
            call.noted = self._noted_slots(cuts, call.entry.direct)
        kept = self._kept_padded_from()
        direct = call.entry.direct
        runner = call.entry.runner
        noted = call.noted
        outputs = []
        for index, (result, (kind, detail), cut) in enumerate(zip(results, self._outputs_rules, cuts, strict=True)):
            if kind == "input":
                outputs.append(args[detail])
            elif kind == "size":
                outputs.append(evaluate(detail, call.values))
            elif cut is not None and index < kept:  # a copy, never a view: AOTAutograd replays an output that
                tensor = host_copies.cut(to_tensor(result) if direct else result, cut)  # aliases an input
                if noted[index] is not None:
                    self._note_cut(tensor, noted[index], result, runner)
                outputs.append(tensor)
            else:  # from the output's base
                outputs.append(runner.export(result) if direct else result)
        return outputs

    def _noted_slots(self, cuts: list[tuple[int, ...] | None], direct: bool) -> list[Any]:
        """Per output, the slot its cuts are noted under (``padded_results``), None where they are not: cuts
        of an output that extends an argument, and cuts of ``NOTED_ELEMENTS`` or more."""
        slots = self._result_slots
        if slots is None or not direct:
            return [None] * len(cuts)
        return [slot if cut is not None and (slot.always_noted or math.prod(cut) >= padded_results.NOTED_ELEMENTS)
                else None for slot, cut in zip(slots, cuts, strict=True)]

    @staticmethod
    def _padded_result(tensor: Any, shape: tuple[int, ...], take: bool) -> Any | None:
        """The padded buffer ``tensor`` was cut from, when it has the argument's padded shape here (``take``:
        for a program that takes it over, so the cut no longer holds it); a cut seen coming back marks its
        output, whose later cuts then keep their buffers (``padded_results``)."""
        cut = padded_results.find(tensor)
        if cut is None:
            return None
        cut.slot.fed_back = True
        if cut.padded_shape != shape:
            return None
        return padded_results.take_buffer(cut) if take else cut.buffer

    @staticmethod
    def _note_cut(tensor: torch.Tensor, slot: padded_results.ResultSlot, result: Any, runner: Any) -> None:
        """Remember where ``tensor`` was cut from, for a call that takes it back (``padded_results``); a
        padded buffer held for it counts among the outputs' memory."""
        padded_results.note_cut(tensor, slot, result)
        if slot.fed_back:
            memory_accounting.device_memory(runner.device).hold(result, memory_accounting.OUTPUTS, result.nbytes)

    @staticmethod
    def _cut_shape(result: Any, rule: tuple[str, Any], values: dict[sympy.Symbol, int]) -> tuple[int, ...] | None:
        """The actual shape of a runtime-sized result, None when it has no padding to cut."""
        kind, detail = rule
        if kind != "tensor" or not detail:
            return None
        actual = list(result.shape)
        for dim, expr in detail:
            actual[dim] = evaluate(expr, values)
        return tuple(actual) if actual != list(result.shape) else None

    def _hit(self, bucket: Bucket) -> None:
        """A call served by ``bucket``'s executable, compiled before: counted, and the bucket made the most
        recently used."""
        if self._last != bucket:
            self._entries.move_to_end(bucket)
            self._last = bucket
        stats.record_bucket_hit(self.name)

    def _prepare(self, full: list[Any], key: tuple[Any, ...]) -> _Call:
        """What calls with ``full``'s sizes (``key``) run: their bucket's executable (compiled now if it is
        new), the size arguments, and later the shapes their results are cut to."""
        values = read_symbols(self._sources, full)
        self._check(full, values)
        for condition, message in self._assertions:
            decided = condition.xreplace({s: sympy.Integer(v) for s, v in values.items()})
            if not decided.free_symbols and not bool(decided):
                raise RuntimeError(message)
        bucket = self.bucket_of(values)
        entry = self._entries.get(bucket)
        if entry is None:
            entry = self._specialize(bucket, values)
            self._last = bucket
        else:
            self._hit(bucket)
        call = _Call(bucket, entry, values, [size_tensor(values[s]) for s in self.symbols])
        if len(self._calls) >= _MAX_CALLS:
            self._calls.clear()
        self._calls[key] = call
        return call

    def fill(self, sizes: Sequence[int]) -> list[Bucket]:
        """Compile (or load from the cache) the executable of every bucket whose sizes are all in ``sizes``
        and not compiled yet, without running it: a server warmed so starts with no compile for any size up
        to the largest. Returns the buckets compiled."""
        buckets = [b for b in itertools.product(sorted(set(sizes)), repeat=len(self.symbols))
                   if b not in self._entries]
        for bucket in buckets:
            log.info("compiling %s for bucket %s (filling every bucket)", self.name,
                     ", ".join(f"{s}={b}" for s, b in zip(self.symbols, bucket, strict=True)))
            self._compile(bucket)
        return buckets

    def _kept_padded_from(self) -> int:
        """The first output left padded to the bucket: a forward's values saved for a backward that takes
        them so (``contracts/saved_handoff``); past the last output otherwise."""
        handoff = self._handoff
        if handoff is None or not handoff.backward_takes_padded or handoff.returns is None:
            return len(self._outputs_rules)
        return handoff.returns

    def _check(self, args: list[Any], values: dict[sympy.Symbol, int]) -> None:
        """Refuse a call whose sizes disagree with the graph's symbolic sizes (``2*s0`` against 5); a value
        saved for a bucketed backward may be padded past them (to its forward's bucket)."""
        for position, (meta, actual) in enumerate(zip(self._metas, args, strict=True)):
            if not isinstance(meta, torch.Tensor):
                continue
            expected = shape_at(meta, values)
            if expected == tuple(actual.shape) or (
                    position in self._may_arrive_padded and actual.dim() == len(expected)
                    and all(have >= want for have, want in zip(actual.shape, expected, strict=True))):
                continue
            raise UnsupportedOpError(f"input of shape {tuple(actual.shape)} does not satisfy the symbolic "
                                     f"shape {tuple(meta.shape)} (evaluates to {expected})")

    def _specialize(self, bucket: Bucket, values: dict[sympy.Symbol, int]) -> tuple[Callable, dict]:
        bounds = dict(zip(self.symbols, bucket, strict=True))
        described = ", ".join(f"{s}={values[s]} -> bucket {b}" for s, b in bounds.items())
        if self._last is not None:
            self.recompiles.append(described)
            stats.record_recompile(self.name, f"new bucket: {described}")
            log.info("compiling %s for a new bucket: %s (%d buckets compiled)", self.name, described,
                     len(self._entries) + 1)
        return self._compile(bucket)

    def _results_per_output(self, runner: Any) -> list[int | None] | None:
        """Per output, the program result ``runner.execute`` returns for it, or None for an output this graph
        supplies itself (a size, read from the call's values; an argument returned as it is), when every output
        is one or the other; None when the runner's outputs are not so (``_BucketEntry.direct``)."""
        if not isinstance(runner, GraphExecutable):
            return None
        per_output = runner.results_per_output
        if per_output is None or len(per_output) != len(self._outputs_rules):
            return None
        if any(index is None and kind not in ("size", "input")
               for index, (kind, _) in zip(per_output, self._outputs_rules, strict=True)):
            return None
        return per_output

    def _compile(self, bucket: Bucket) -> _BucketEntry:
        bounds = dict(zip(self.symbols, bucket, strict=True))
        extents = {position: tuple(n + e for n, e in zip(shape_at(self._metas[position], bounds), extra, strict=True))
                   for position, extra in self._headroom.items()}
        runner = self._build(bounds, frozenset(self.symbols), extents)
        spread = self._results_per_output(runner)
        direct = spread is not None
        stage = self._stage and direct and shares_host_memory(runner.device)
        donated = {runner.input_positions[slot] for slot in runner.donated_slots} if direct else set()
        pads = []
        for position, _ in self._padded:
            meta = self._metas[position]
            shape = extents.get(position) or shape_at(meta, bounds)
            staged = StagedInput(shape, meta.dtype) if stage else None  # a donated slot takes a copy of it
            pads.append((position, shape, staged))
        spread = None if spread is None or None not in spread else tuple(spread)
        entry = _BucketEntry(runner, pads, direct, frozenset(donated), spread)
        keep_bounded(self._entries, bucket, entry, self._max_entries, f"{self.name} dropped the executable for bucket")
        self._calls.clear()  # a call prepared for a dropped bucket would keep its executable alive
        return entry


@dataclasses.dataclass
class _BucketEntry:
    """One bucket's executable and how its padded inputs are made: per runtime-sized argument, its position,
    its shape in the bucket and the tensor it is written into (``staged_inputs``), or None to pad a new one.
    ``direct``: the runner is one executable whose results are the outputs in order (but for outputs the graph
    supplies itself: ``spread``), taken as device buffers so that a result cut to its actual sizes is not first
    exported and counted."""

    runner: Any
    pads: list[tuple[int, tuple[int, ...], StagedInput | None]]
    direct: bool
    donated: frozenset[int] = frozenset()
    """The argument positions the program takes over (a cache grown in place: ``lowering/grown_in_place``)."""
    spread: tuple[int | None, ...] | None = None
    """With ``direct``, where some outputs are not program results (a size: a sliding-window cache's length):
    per output, the index of its result, or None. None when the results are the outputs one to one."""


@dataclasses.dataclass
class _Call:
    """What a call with one set of argument sizes runs: its bucket, the bucket's entry, the symbols' values,
    the size arguments, and per output the shape it is cut to (None: not cut), known after the first call."""

    bucket: Bucket
    entry: _BucketEntry
    values: dict[sympy.Symbol, int]
    sizes: list[torch.Tensor]
    cuts: list[tuple[int, ...] | None] | None = None
    noted: list[Any] | None = None
    """Per output, the slot under which its cuts are noted, or None (``BucketedGraph._noted_slots``); known
    with ``cuts``."""


_MAX_CALLS = 4096
"""Sets of sizes whose calls are remembered per graph; past it they are prepared again."""

_LIVE: weakref.WeakSet[BucketedGraph] = weakref.WeakSet()


def live_graphs() -> list[BucketedGraph]:
    """The bucketed graphs of this process that are still in use (``tpucompile warm --buckets`` fills them)."""
    return sorted(_LIVE, key=lambda graph: graph.name)


def _graph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    outputs = gm.graph.output_node().args[0]
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@functools.lru_cache(maxsize=4096)
def size_tensor(value: int) -> torch.Tensor:
    """The size argument ``value`` as a tensor, one per value: a call with the sizes of the previous one passes
    the same tensors, whose device buffers the executable reuses instead of importing new ones."""
    return torch.tensor(value, dtype=SIZE_DTYPE)
