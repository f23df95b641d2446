"""Compiling for a compile-only target: XLA's executable for devices that are not here, what it needs of each
chip, and the bytes a host that has those devices loads.

A failure names the graph, the op (from the location every StableHLO op carries, which XLA keeps in its
HLO metadata) and the target. One kind is caught before XLA sees the program: complex128 on a TPU, on
which libtpu's compiler aborts the whole process on some ops instead of failing.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from jax.extend.mlir import ir

from tpucompile.contracts.loop_ops import TRIPS_PREFIX
from tpucompile.errors import CompileError
from tpucompile.runtime.compiler import for_target
from tpucompile.runtime.mlir_walk import walk_operations
from tpucompile.runtime.targets.local import Target
from tpucompile.runtime.xla_options import compile_options


class TargetCompileError(CompileError):
    """A graph cannot be compiled for a compile-only target."""

    def __init__(self, message: str, target: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.target = target
        self.out_of_memory = out_of_memory


@dataclasses.dataclass(frozen=True)
class TargetExecutable:
    """An executable compiled for a target, not loaded."""

    executable: Any
    seconds: float

    def serialize(self) -> bytes:
        return self.executable.serialize()

    def report(self) -> dict[str, Any]:
        """Bytes per chip by use, flops, and the rest of XLA's cost analysis: what ``dump-hlo`` shows and cache
        entries keep."""
        stats = self.executable.get_compiled_memory_stats()
        memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in
                  ("argument", "output", "alias", "temp", "generated_code")}
        memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0) or (
            memory["argument"] + memory["output"] - memory["alias"] + memory["temp"] + memory["generated_code"])
        cost = cost_analysis(self.executable)
        return {"memory": memory, "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
                "transcendentals": cost.get("transcendentals"), "optimal_seconds": cost.get("optimal_seconds"),
                "estimated_cycles": estimated_cycles(self.executable)}


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_COMPUTATION_END = re.compile(r"\n\}[ \t]*(?:\n|$)")
_LOOP = re.compile(r'= [^\n]*? while\([^\n]*?\bbody=%?(?P<body>[\w.\-]+)[^\n]*?op_name="'
                   + re.escape(TRIPS_PREFIX) + r'(?P<n>\d+)"')


def estimated_cycles(executable: Any) -> int | None:
    """The sum of the TPU compiler's cycle estimates of the entry computation's instructions (each fusion's
    figure covers its body), as if none overlapped: a time estimate where ``optimal_seconds`` has none. A loop
    (rolled layers) counts its body's instructions once per iteration. None where the compiler writes no
    estimates (other platforms)."""
    total, found = 0, False
    try:
        modules = executable.hlo_modules()
    except Exception:
        return None
    for module in modules:
        text = module.to_string()  # a large program's text is hundreds of MB: read it in place, no line copies
        start = text.find("\nENTRY ")
        if start < 0:
            continue
        cycles, any_found = _computation_cycles(text, start, 1)
        total, found = total + cycles, found or any_found
        del text
    return total if found else None


def _computation_cycles(text: str, start: int, repeat: int) -> tuple[int, bool]:
    """The cycle estimates of the computation whose header line starts at ``start`` (a newline), its loops'
    bodies counted per iteration."""
    closing = _COMPUTATION_END.search(text, start + 1)  # a bare "}" line: a Pallas kernel's multi-line
    end = closing.start() if closing else len(text)  # metadata has lines that start with "}" inside it
    total, found = 0, False
    for match in _CYCLES.finditer(text, start, end):
        total, found = total + repeat * int(match[1]), True
    for loop in _LOOP.finditer(text, start, end):
        header = re.search(rf"\n%?{re.escape(loop['body'])} ", text)
        if header is not None:
            cycles, body_found = _computation_cycles(text, header.start(), repeat * int(loop["n"]))
            total, found = total + cycles, found or body_found
    return total, found


def cost_analysis(executable: Any) -> dict[str, float]:
    """XLA's whole-program cost figures for ``executable``: ``flops``, ``bytes accessed`` (memory traffic as the
    target's compiler counts it), ``transcendentals``, and on TPUs ``optimal_seconds`` (its cost model's time
    estimate, negative where the model has none). Per-operand breakdowns are left out; empty when the
    compiler gives none."""
    try:
        analysis = executable.cost_analysis()
    except Exception:
        return {}
    if isinstance(analysis, list):  # one per HLO module on some jaxlib versions
        analysis = analysis[0] if analysis else {}
    if not isinstance(analysis, dict):
        return {}
    return {k: float(v) for k, v in analysis.items() if "{" not in k and isinstance(v, (int, float))}


_UNSUPPORTED = {"tpu": {"complex<f64>": "TPUs have no complex128 (use complex64)"}}
_LOCATION = re.compile(r'loc\("(?P<op>[^"(]+)"\("(?P<file>[^"]+)":(?P<line>\d+):\d+\)\)')


def check_supported(module: ir.Module, target: Target, name: str) -> None:
    """Refuse ``module`` up front when it holds a type ``target``'s compiler cannot take safely."""
    forbidden = _UNSUPPORTED.get(target.platform)
    if not forbidden:
        return
    for op in walk_operations(module.operation):
        types = [str(v.type) for v in (*op.operands, *op.results)]
        for type_text in types:
            for element, why in forbidden.items():
                if element in type_text:
                    raise TargetCompileError(
                        f"{name} cannot be compiled for {target.name}: {_where(str(op.location), op.name)} "
                        f"computes {type_text}; {why}", str(target.name))


def _where(location: str, fallback: str) -> str:
    match = _LOCATION.search(location)
    if match is None:
        return fallback
    return f"{match['op']} at {match['file']}:{match['line']}"


def compile_for(module: ir.Module, target: Target, name: str, depthwise_taps: bool = True) -> TargetExecutable:
    """Compile ``module`` (parsed in a jax MLIR context; compile-only clients refuse text and bytes) for
    ``target``'s devices; ``TargetCompileError`` naming the graph, the op and the target when XLA refuses.
    ``depthwise_taps``: as ``compiler.for_target``."""
    check_supported(module, target, name)
    start = time.perf_counter()
    try:
        if getattr(target.client, "runtime_type", "") == "compile_only_runtime":
            executable = target.client.compile(module, executable_devices=target.device_list(),
                                               compile_options=compile_options(target))
        else:  # a platform of this machine: its client compiles only by loading
            program = for_target(module.operation.get_asm(enable_debug_info=True), target,
                                 depthwise_taps=depthwise_taps)
            executable = _Loaded(target.client, target.client.compile_and_load(
                program, target.device_list(), compile_options(target)))
    except Exception as error:
        raise explain(error, target, name, module) from error
    return TargetExecutable(executable, time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """A loaded executable of a local platform, with a compile-only executable's ``serialize``."""

    client: Any
    loaded: Any

    def serialize(self) -> bytes:
        return self.client.serialize_executable(self.loaded)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.loaded, attribute)


_OP_NAME = re.compile(r'op_name="(?P<op>[^"]+)"')
_INSTRUCTION = re.compile(r"%\S+ = (?P<shape>\S+?)(?:\{[^}]*\})? (?P<opcode>[a-z-]+)\(")


def explain(error: Exception, target: Target, name: str, module: ir.Module | None = None) -> TargetCompileError:
    """XLA's refusal to compile ``name`` for ``target``, in words that say which op of the user's code: XLA
    names the op in its HLO metadata, and the op's location in ``module`` gives the line."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
        return TargetCompileError(f"{name} does not fit {target.name}: {first}", str(target.name), True)
    parts = []
    op = _OP_NAME.search(text)
    if op is not None:
        parts.append(op["op"])
        locations = (_LOCATION.search(str(o.location)) for o in walk_operations(module.operation)) if module else ()
        where = next((m for m in locations if m is not None and m["op"] == op["op"]), None)
        if where is not None:
            parts.append(f"at {where['file']}:{where['line']}")
    instruction = _INSTRUCTION.search(text)
    if instruction is not None:
        parts.append(f"({instruction['opcode']} of {instruction['shape']})")
    where = f": {' '.join(parts)}" if parts else ""
    return TargetCompileError(f"{name} cannot be compiled for {target.name}{where}: {first}", str(target.name))
