"""Walking an MLIR module's operations, nested regions included (the bindings have no walk of their own), and
rewriting every operation of one kind in place."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jax.extend.mlir import ir
from jax.interpreters import mlir as jax_mlir

_local = threading.local()


def walk_operations(operation: Any) -> Iterator[Any]:
    """Every operation inside ``operation``'s regions, depth first, parents before their children."""
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from walk_operations(op.operation)


def context() -> ir.Context:
    """This thread's MLIR context with every dialect the rewrites meet (ops of one module must share one)."""
    found = getattr(_local, "context", None)
    if found is None:
        found = _local.context = jax_mlir.make_ir_context()
    return found


def mentions(module: bytes | str, names: Iterable[str]) -> bool:
    """Whether ``module``'s text or bytecode holds the short name of any operation in ``names``
    (``stablehlo.convolution`` → ``convolution``): a module that does not is skipped without a parse."""
    markers = [name.split(".")[-1] for name in names]
    return any((m if isinstance(module, str) else m.encode()) in module for m in markers)


def rewrite_each(module: bytes | str, replacements: dict[str, Callable[[Any], bool]],
                 select: Callable[[Any], bool] | None = None) -> bytes | str:
    """``module`` (text or bytecode) after each of its operations named in ``replacements`` (e.g.
    ``stablehlo.convolution``) has been handed to that name's function, which returns whether it rewrote it;
    unchanged (the same object) when none was. ``select``, when given, picks the operations to hand over; it
    sees every one before any is rewritten. One parse and one serialisation serve every kind, and the module
    is parsed only when its text or bytecode mentions one of them."""
    if not mentions(module, replacements):
        return module
    with context(), ir.Location.unknown():
        parsed = ir.Module.parse(module)
        found = [op for op in walk_operations(parsed.operation) if op.name in replacements]
        if select is not None:
            found = [op for op in found if select(op)]
        if not sum(replacements[op.name](op) for op in found):
            return module
        stream = io.BytesIO()
        parsed.operation.write_bytecode(stream)
        return stream.getvalue()
