"""One executable per bucket of sizes for graphs with symbolic sizes.

Where the per-size path (``specialize``) compiles every new size, a bucketed graph rounds each size symbol up
to its bucket (the next power of two from ``bucket_minimum``, or the smallest of the ``buckets`` option that
holds it), compiles once per bucket a program that takes the actual sizes as arguments
(``lowering.dynamic_sizes``), pads each runtime-sized input with zeros at the end of its dimensions, and cuts
each result back to its actual sizes. A size above the largest listed bucket gets an executable of its own.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
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
    runtime_symbols,
    shape_at,
    symbol_sources,
    symbolic_dims,
)
from tpucompile.errors import UnsupportedOpError
from tpucompile.metrics import compile_stats as stats
from tpucompile.runtime import host_copies
from tpucompile.runtime.input_views import input_views, replace_views
from tpucompile.runtime.specialize import call_signature, keep_bounded

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
        build: Callable[[dict[sympy.Symbol, int], frozenset[sympy.Symbol]], Callable[[list[Any]], list[Any]]],
        constants: Sequence[torch.Tensor],
        bucket_sizes: Sequence[Any],
        bucket_minimum: int,
        max_entries: int,
        handoff: HandoffEnd | None = None,
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
        self._outputs = [self._output_rule(out, placeholders, runtime) for out in _graph_outputs(gm)]
        self._views = input_views(gm)
        self._entries: collections.OrderedDict[Bucket, tuple[Callable, dict[int, tuple[int, ...]]]] = (
            collections.OrderedDict())
        self._checked: set[Any] = set()
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
        values = read_symbols(self._sources, full)
        signature = call_signature(full)
        if signature not in self._checked:
            self._check(full, values)
            self._checked.add(signature)
        bucket = self.bucket_of(values)
        entry = self._entries.get(bucket)
        if entry is None:
            entry = self._specialize(bucket, values)
        else:
            if self._last != bucket:
                self._entries.move_to_end(bucket)
            stats.record_bucket_hit(self.name)
        self._last = bucket
        runner, shapes = entry
        padded = list(full)
        for position, _ in self._padded:
            padded[position] = host_copies.pad(full[position], shapes[position])
        sizes = [size_tensor(values[s]) for s in self.symbols]
        results = runner([*padded, *sizes])
        kept = self._kept_padded_from()
        outputs = [result if index >= kept and rule[0] == "tensor" else self._output(result, rule, full, values)
                   for index, (result, rule) in enumerate(zip(results, self._outputs, strict=True))]
        return replace_views(outputs, self._views, full, values) if self._views else outputs

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
            return len(self._outputs)
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

    def _output(self, result: Any, rule: tuple[str, Any], args: list[Any], values: dict) -> Any:
        kind, detail = rule
        if kind == "input":
            return args[detail]
        if kind == "size":
            return evaluate(detail, values)
        if kind == "tensor" and detail and isinstance(result, torch.Tensor):
            actual = list(result.shape)
            for dim, expr in detail:
                actual[dim] = evaluate(expr, values)
            if actual != list(result.shape):  # a copy, never a view: AOTAutograd replays an output that aliases
                return host_copies.cut(result, actual)  # an input from the output's base
        return result

    def _specialize(self, bucket: Bucket, values: dict[sympy.Symbol, int]) -> tuple[Callable, dict]:
        bounds = dict(zip(self.symbols, bucket, strict=True))
        described = ", ".join(f"{s}={values[s]} -> bucket {b}" for s, b in bounds.items())
        if self._last is not None:
            self.recompiles.append(described)
            stats.record_recompile(self.name, f"new bucket: {described}")
            log.info("compiling %s for a new bucket: %s (%d buckets compiled)", self.name, described,
                     len(self._entries) + 1)
        return self._compile(bucket)

    def _compile(self, bucket: Bucket) -> tuple[Callable, dict]:
        bounds = dict(zip(self.symbols, bucket, strict=True))
        shapes = {position: shape_at(self._metas[position], bounds) for position, _ in self._padded}
        entry = (self._build(bounds, frozenset(self.symbols)), shapes)
        keep_bounded(self._entries, bucket, entry, self._max_entries, f"{self.name} dropped the executable for bucket")
        return entry


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
