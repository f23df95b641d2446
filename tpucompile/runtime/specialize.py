"""One executable per concrete shape for graphs with symbolic sizes.

Dynamo marks sizes dynamic after it has seen two shapes; XLA compiles static shapes. The specializer keys
each call on its argument sizes, builds an executable the first time a key is seen, and logs the reason for
every recompile (which argument, which dimension, old and new size).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpucompile.contracts.size_expressions import read_symbols, runtime_symbols, symbol_sources
from tpucompile.metrics import compile_stats as stats
from tpucompile.runtime.input_views import InputView, replace_views

log = logging.getLogger("tpucompile")

Signature = tuple[Any, ...]


def call_signature(args: Sequence[Any]) -> Signature:
    """Sizes of tensor arguments and values of scalar arguments: what an executable is specialised on."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


def recompile_reason(previous: Signature, current: Signature, names: Sequence[str]) -> str:
    changes = []
    for index, (old, new) in enumerate(zip(previous, current, strict=True)):
        if old == new:
            continue
        name = names[index] if index < len(names) else f"arg{index}"
        if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
            for dim, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b:
                    changes.append(f"input {index} ({name}) dim {dim}: {a} -> {b}")
        else:
            changes.append(f"input {index} ({name}): {old} -> {new}")
    return "; ".join(changes) or "no size changed"


def keep_bounded(entries: collections.OrderedDict, key: Any, value: Any, max_entries: int, dropped: str) -> None:
    """Add ``value`` under ``key`` as the most recent entry, dropping (and logging, ``dropped`` then the key)
    the least recently used past ``max_entries``."""
    entries[key] = value
    if len(entries) > max_entries:
        old, _ = entries.popitem(last=False)
        log.info("%s %s (max_shape_specializations=%d)", dropped, old, max_entries)


class ShapeSpecializer:
    """A boxed callable that dispatches each call to the executable built for its sizes."""

    def __init__(
        self,
        name: str,
        build: Callable[[list[Any]], Callable[[list[Any]], Any]],
        input_names: Sequence[str],
        max_entries: int,
        views: Sequence[InputView] = (),
        metas: Sequence[Any] = (),
    ) -> None:
        self._boxed_call = True  # AOTAutograd passes the arguments as one list (an instance
        # attribute, so that the wrappers Dynamo puts around a backward copy it with the __dict__)
        self.name = name
        self._build = build
        self._input_names = list(input_names)
        self._max_entries = max(1, max_entries)
        self._views = list(views)
        """Outputs that are views of inputs, remade from the actual inputs (``input_views``)."""
        self._sources = symbol_sources(metas, runtime_symbols(metas)) if views else {}
        self._entries: collections.OrderedDict[Signature, Callable] = collections.OrderedDict()
        self._last: Signature | None = None
        self.recompiles: list[str] = []
        """The reason of every compile after the first, in order."""

    def __call__(self, args: list[Any]) -> Any:
        signature = call_signature(args)
        runner = self._entries.get(signature)
        if runner is None:
            runner = self._specialize(signature, args)
        elif self._last != signature:
            self._entries.move_to_end(signature)
        self._last = signature
        if not self._views:
            return runner(args)
        outputs = list(runner(args))
        return replace_views(outputs, self._views, args, read_symbols(self._sources, args))

    def _specialize(self, signature: Signature, args: list[Any]) -> Callable:
        if self._last is not None:
            reason = recompile_reason(self._last, signature, self._input_names)
            self.recompiles.append(reason)
            stats.record_recompile(self.name, f"new sizes: {reason}")
            log.info("recompiling %s for new sizes: %s (%d shapes compiled)",
                     self.name, reason, len(self._entries) + 1)
        runner = self._build(args)
        keep_bounded(self._entries, signature, runner, self._max_entries, f"{self.name} dropped the executable "
                     "for sizes")
        return runner
