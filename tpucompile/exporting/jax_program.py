"""A StableHLO module tpucompile lowered, made into a ``jax.export.Exported`` (jax's portable, versioned
serialisation), so that a process with jax alone can deserialise and call it.

The module is not handed to jax as opaque bytes: a jax primitive whose lowering splices the module's functions
into the module jax is building (renamed to private symbols that cannot clash) and calls its ``main`` stands
for the whole program. ``jax.export.export`` then lowers a jitted function that binds that primitive, so jax
itself writes everything its deserialiser checks (calling-convention version, argument and result avals,
platforms, the custom-call safety check, the portable-artifact encoding). This is ``lowering.jax_bridge`` in
reverse: there a jax function is spliced into our module; here our module is spliced into jax's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func
from jax.interpreters import mlir as jax_mlir

_PREFIX = "tpucompile_program"


class _ModuleBytes:
    """The module's bytecode as a primitive parameter: jax hashes and compares parameters."""

    def __init__(self, bytecode: bytes, result_avals: Sequence[jax.core.ShapedArray]) -> None:
        self.bytecode = bytecode
        self.result_avals = tuple(result_avals)
        self.digest = hashlib.sha256(bytecode).hexdigest()[:16]

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ModuleBytes) and other.bytecode == self.bytecode


_program = Primitive(_PREFIX)
_program.multiple_results = True
_program.def_abstract_eval(lambda *avals, module: list(module.result_avals))
_program.def_impl(lambda *args, module: jax.jit(lambda *a: _program.bind(*a, module=module))(*args))


def _lower_program(ctx: Any, *args: ir.Value, module: _ModuleBytes) -> Sequence[ir.Value]:
    """Splice the functions of ``module`` into the module jax is building and call its ``main``."""
    parsed = ir.Module.parse(module.bytecode)
    functions = [op for op in parsed.body.operations if op.operation.name == "func.func"]
    source = ir.SymbolTable(parsed.operation)
    entry = f"{_PREFIX}_{module.digest}"
    renamed = {}
    for op in functions:
        old = ir.SymbolTable.get_symbol_name(op).value
        renamed[old] = entry if old == "main" else f"{entry}_{old}"
    for op in functions:
        source.set_symbol_name(op, renamed[ir.SymbolTable.get_symbol_name(op).value])
        op.attributes["sym_visibility"] = ir.StringAttr.get("private")
    for old, new in renamed.items():
        for op in functions:
            ir.SymbolTable.replace_all_symbol_uses(old, new, op.operation)
    table = ctx.module_context.symbol_table
    for op in functions:
        name = ir.SymbolTable.get_symbol_name(op).value
        for attribute in ("arg_attrs", "res_attrs") if name == entry else ():
            if attribute in op.attributes:
                del op.attributes[attribute]
        if name in table:  # the same program spliced in once already
            continue
        ctx.module_context.module.body.append(op.operation)
        table.insert(op.operation)
    main = table[entry].operation.opview
    call = func.CallOp(list(main.type.results), ir.FlatSymbolRefAttr.get(entry), list(args))
    return list(call.results)


jax_mlir.register_lowering(_program, _lower_program)


def exported_program(
    bytecode: bytes,
    input_avals: Sequence[jax.ShapeDtypeStruct],
    result_avals: Sequence[jax.ShapeDtypeStruct],
    platforms: Sequence[str] = ("cpu",),
    name: str = "tpucompile_export",
) -> jax.export.Exported:
    """A ``jax.export.Exported`` that runs the StableHLO module ``bytecode`` (its ``main`` takes
    ``input_avals``, returns ``result_avals``) for ``platforms``; its ``call`` takes and returns flat
    positional arrays (a list of results)."""
    with jax.enable_x64(True):  # 64-bit arguments and results keep their types
        module = _ModuleBytes(bytecode, [jax.core.ShapedArray(a.shape, a.dtype) for a in result_avals])

        def run(*args: Any) -> list[Any]:
            return _program.bind(*args, module=module)

        run.__name__ = name
        return jax.export.export(jax.jit(run), platforms=tuple(platforms))(*input_avals)
