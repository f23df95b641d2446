"""Which matrix products and convolutions of a CPU program go to the host kernels: decided per op by timing.

The host kernels (``dots``, ``convolutions``) beat XLA's own dots and convolutions on some shapes
and lose on others, and where the line falls depends on the machine: its cores, its BLAS, the threads torch
and XLA keep busy. So, as Inductor's autotuner does, each distinct op is timed both ways on this machine the
first time a program holding it is compiled, and goes to the host kernel only where that is measurably faster;
then the program itself is timed with and without the chosen ops calling the kernels, and keeps them only
where the whole program gains (an op alone does not show the fusions its program loses around a call). That
check costs two compiles of the whole program, so by default it is not made here but on the program's own
calls, after its first compile (``ProgramCheck``, ``record_program_verdict``; the driver's
``host_kernel_upgrades``).

An op is identified by its *micro-program*: a one-op StableHLO function holding the op and the chain of
transposes its operands are read through (what the kernel's rewrite looks at), printed without locations.
That text, hashed together with what describes the machine (``_machine``), is the op's signature. A decision
is stored per signature in a small JSON file in the host kernels' build directory (per machine, like the
compiled library), so it is measured once per machine, not once per process. The signatures a program's
host-kernel calls carry are part of its executable cache key: a program compiled with other choices is
another executable.

Modes (option ``host_kernels``): "auto" measures, "on" sends every op the kernels take (the kernels' own
tests and benchmarks), "off" keeps XLA's ops everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import filelock
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tpucompile.runtime import depthwise
from tpucompile.runtime.custom_calls import make_ready
from tpucompile.runtime.host_kernels import library
from tpucompile.runtime.host_kernels.convolutions import CONVOLUTION_REPLACEMENTS
from tpucompile.runtime.host_kernels.dots import dot_replacements
from tpucompile.runtime.mlir_walk import context, mentions, rewrite_each, walk_operations
from tpucompile.runtime.transfer import to_buffer
from tpucompile.runtime.xla_options import compile_options

log = logging.getLogger("tpucompile")


WIN_RATIO = 0.95
"""The host kernel is chosen only where its best time is at most this fraction of XLA's (a choice inside the
timing noise would be a coin toss) and its median time is no worse than XLA's: a BLAS whose threads stall
when another process holds a core loses in the median, not in the best."""
_ROUNDS = 5
"""Alternating rounds of timed calls per variant (drift hits both alike)."""
_ROUND_SECONDS = 0.004
"""Each round times calls until this long has passed (at least one call)."""
_LOCK_PATIENCE_SECONDS = 2.0
"""How long a process waits for another process's timing (the machine's lock) before it compiles on without
the decision, keeping XLA's op: a timing takes a second or two, and a holder that stalls (a process stopped
or swapped out mid-compile) must never stall, let alone fail, another process's compile."""
_RECORD_PATIENCE_SECONDS = 0.1
"""How long storing a verdict made on a program's own calls waits for the machine's lock: it is taken on a
user's call, which must not wait on another process's timing (unsaved, the verdict holds for this process)."""
_BUSY_SECONDS = 30.0
"""After one wait ran out, how long the process asks for the lock without waiting at all: a compile holds
several ops, and each would otherwise wait out the patience again behind the same stalled holder."""


def host_replacements(kernels: library.HostBlas) -> dict[str, Callable[[Any], bool]]:
    """The rewrites of every op kind the host ``kernels`` take (for ``mlir_walk.rewrite_each``)."""
    replacements = dot_replacements(kernels.dtypes)
    if kernels.convolutions:
        replacements.update(CONVOLUTION_REPLACEMENTS)
    return replacements


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """Ops that won one by one, in a program whose own verdict is not stored yet: the program is to be timed
    with and without them on its own calls (``record_program_verdict``)."""

    ops: tuple[str, ...]
    sign: str
    what: str


def chosen_ops(module: bytes | str, target: Any, mode: str, defer_program_check: bool = False
               ) -> tuple[str, ...] | ProgramCheck:
    """The sorted signatures of ``module``'s ops that call the host kernels when compiled for ``target``: every
    op they take ("on"), the ones measured faster there ("auto"), or none ("off", or no kernels). With
    ``defer_program_check``, a program whose verdict is not stored is not timed here: a ``ProgramCheck``
    says which ops await it."""
    kernels = target.host_blas
    if mode == "off" or kernels is None or len(target.devices) != 1:
        return ()
    replacements = host_replacements(kernels)
    if not mentions(module, replacements):
        return ()
    chosen = set()
    with context(), ir.Location.unknown():
        parsed = ir.Module.parse(module)
        for op in walk_operations(parsed.operation):
            if op.name not in replacements:
                continue
            micro = micro_program(op)
            host = rewrite_each(micro, replacements)
            if host is micro:  # the kernels do not take this op
                continue
            sign = signature(micro)
            if mode == "on" or _decisions().host_is_faster(sign, micro, lambda host=host: host, target, describe(op)):
                chosen.add(sign)
        program = parsed.operation.get_asm(enable_debug_info=False)
    ops = tuple(sorted(chosen))
    if mode != "auto" or not ops:
        return ops
    if defer_program_check:
        check = ProgramCheck(ops, _program_sign(program, ops), f"a program with {len(ops)} host-kernel op(s)")
        verdict = _decisions().stored(check.sign)
        if verdict is None:
            return check
        return ops if verdict else ()
    return ops if _program_gains(program, list(ops), target) else ()


def record_program_verdict(check: ProgramCheck, xla_rounds: list[float], host_rounds: list[float]) -> bool:
    """Store for this machine whether ``check``'s program keeps its host-kernel ops, by the timings of its
    calls both ways (seconds per call, alternating), and return it (the same rule as an op's)."""
    return _decisions().record(check.sign, check.what, xla_rounds, host_rounds)["host"]


def _program_sign(program: str, chosen: Iterable[str]) -> str:
    return signature(program + "\n" + ",".join(chosen))


def _program_gains(program: str, chosen: list[str], target: Any) -> bool:
    """Whether the whole ``program`` (text without locations) runs faster with the ops ``chosen`` alone
    calling the host kernels.

    An op timed alone does not show what its program loses around a custom call: XLA fuses a product's bias
    and activation into its own dot, not into a call, and each call has a fixed cost. So the chosen set is
    timed in its program once (per machine, like the ops), and dropped unless the program gains."""
    sign = _program_sign(program, chosen)
    what = f"a program with {len(chosen)} host-kernel op(s)"
    return _decisions().host_is_faster(sign, program, lambda: apply(program, target, chosen), target, what)


def apply(module: bytes | str, target: Any, chosen: Iterable[str] | None) -> bytes | str:
    """``module`` with the ops whose signatures are in ``chosen`` calling the host kernels (every op they take
    when ``chosen`` is None); unchanged (the same object) when none is rewritten."""
    kernels = target.host_blas
    if kernels is None or len(target.devices) != 1:
        return module
    select = None
    if chosen is not None:
        wanted = frozenset(chosen)
        if not wanted:
            return module
        select = lambda op: signature(micro_program(op)) in wanted  # noqa: E731
    return rewrite_each(module, host_replacements(kernels), select)


def micro_program(op: Any) -> str:
    """The one-op program that stands for ``op``: its operands (read through the transposes that define them)
    become arguments, and it returns the op's results; printed without locations."""
    chain: list[Any] = []
    arguments: list[Any] = []

    def leaves(value: Any) -> None:
        owner = value.owner
        if not isinstance(owner, ir.Block) and owner.operation.name == "stablehlo.transpose":
            leaves(owner.operands[0])
            chain.append(owner.operation)
        elif not any(value == known for known in arguments):
            arguments.append(value)

    for operand in op.operands:
        leaves(operand)
    with context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            function = func.FuncOp("main", ir.FunctionType.get([a.type for a in arguments],
                                                                [r.type for r in op.results]))
            function.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = function.add_entry_block()
            mapping = list(zip(arguments, block.arguments, strict=True))
            with ir.InsertionPoint(block):
                for original in [*chain, op]:
                    copy = original.clone()
                    for index, operand in enumerate(original.operands):
                        copy.operands[index] = _mapped(mapping, operand)
                    mapping.extend(zip(original.results, copy.results, strict=True))
                func.ReturnOp([_mapped(mapping, r) for r in op.results])
        return module.operation.get_asm(enable_debug_info=False)


def _mapped(mapping: list[tuple[Any, Any]], value: Any) -> Any:
    for original, copy in mapping:
        if original == value:
            return copy
    raise AssertionError("an operand of the micro-program has no value")


def describe(op: Any) -> str:
    """A line naming ``op`` for people: its kind and operand and result types."""
    operands = ", ".join(str(v.type) for v in op.operands)
    results = ", ".join(str(v.type) for v in op.results)
    return f"{op.name} ({operands}) -> {results}"


def signature(micro: str) -> str:
    """The short digest identifying a micro-program on this machine."""
    return hashlib.sha256((_machine() + "\n" + micro).encode()).hexdigest()[:24]


@functools.cache
def _machine() -> str:
    """What decides a timing besides the op: the kernels' code and BLAS, the processor, the cores this process
    may use, torch's thread count (the BLAS's team on the calling thread) and XLA's flags."""
    kernels = library.kernels()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    model = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return json.dumps({"kernels": kernels.fingerprint if kernels else None, "cpu": model, "cores": cores,
                       "torch_threads": torch.get_num_threads(), "xla_flags": os.environ.get("XLA_FLAGS", "")})


class _Decisions:
    """Measured decisions by signature: in memory, and in a JSON file per machine shared by its processes."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.known: dict[str, dict[str, Any]] = self._read()
        self.lock = threading.Lock()
        self.busy_since: float | None = None
        """When a wait for another process's timing last ran out (``_BUSY_SECONDS``)."""

    def host_is_faster(
        self, sign: str, xla_program: str, host_program: Callable[[], str], target: Any, what: str
    ) -> bool:
        """The stored decision for ``sign``, or a new one by timing ``xla_program`` against the program
        ``host_program()`` builds (built only then: a stored decision needs no rewrite)."""
        with self.lock:
            found = self.known.get(sign)
            if found is None:
                found = self._measure(sign, xla_program, host_program, target, what)
            return bool(found["host"])

    def stored(self, sign: str) -> bool | None:
        """The decision stored for ``sign`` (by any process of the machine), or None; never waits on a lock
        (another thread may hold it through a long timing)."""
        found = self.known.get(sign)
        if found is None:
            self.known.update(self._read())  # the file is replaced whole: safe to read without the lock
            found = self.known.get(sign)
        return None if found is None else bool(found["host"])

    def record(self, sign: str, what: str, xla_rounds: list[float], host_rounds: list[float]) -> dict[str, Any]:
        """Store the decision that timings made elsewhere say (a program timed on its own calls)."""
        found = _decision(what, xla_rounds, host_rounds)
        with self.lock:
            self.known[sign] = found
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with filelock.FileLock(str(self.path) + ".lock", timeout=_RECORD_PATIENCE_SECONDS):
                    self._write(sign, found)
            except (OSError, filelock.Timeout) as error:  # kept for this process; measured again in the next
                log.debug("tpucompile: host kernel decision for %s not saved: %s", what, error)
        return found

    def _measure(
        self, sign: str, xla_program: str, host_program: Callable[[], str], target: Any, what: str
    ) -> dict[str, Any]:
        """Time the op both ways, one process of the machine at a time: the others wait a moment and take its
        decision (so processes compiling the same program mostly agree on it, and on its key), and no timing
        runs beside another timing. A process that the holder keeps waiting longer (``_LOCK_PATIENCE_SECONDS``)
        goes on with XLA's op, not remembered: a later compile asks again. Its executable's key names the
        choices it made, so it is another executable, never a wrong one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # no lock file can be made: time without one
            return self._measure_locked(sign, xla_program, host_program, target, what)
        lock = filelock.FileLock(str(self.path) + ".lock")
        try:
            held = lock.acquire(timeout=self._patience())
        except filelock.Timeout:
            self.busy_since = time.monotonic()
            self.known.update(self._read())  # the file is replaced whole: safe to read without the lock
            found = self.known.get(sign)
            if found is None:
                log.info("tpucompile: another process holds the host-kernel timing lock (%s); %s keeps "
                         "XLA's op in this compile", lock.lock_file, what)
                found = {"op": what, "host": False}
            return found
        with held:
            return self._measure_locked(sign, xla_program, host_program, target, what)

    def _patience(self) -> float:
        """Seconds to wait for the lock now: none while a recent wait ran out, else ``_LOCK_PATIENCE_SECONDS``."""
        if self.busy_since is not None and time.monotonic() - self.busy_since < _BUSY_SECONDS:
            return 0
        return _LOCK_PATIENCE_SECONDS

    def _measure_locked(
        self, sign: str, xla_program: str, host_program: Callable[[], str], target: Any, what: str
    ) -> dict[str, Any]:
        """``_measure`` once the machine's lock is held (or where no lock file can be made)."""
        self.known.update(self._read())
        found = self.known.get(sign)
        if found is not None:
            return found
        try:
            xla_rounds, host_rounds = time_both(xla_program, host_program(), target)
        except Exception as error:  # a timing that fails leaves the op with XLA; it never fails a compile
            log.warning("tpucompile: could not time the host kernel for %s, XLA's op is kept: %s", what, error)
            self.known[sign] = {"op": what, "host": False}  # for this process; timed again in the next
            return self.known[sign]
        found = _decision(what, xla_rounds, host_rounds)
        self.known[sign] = found
        self._write(sign, found)
        log.debug("tpucompile: host kernel %s for %s (median %.0f us against XLA's %.0f us)",
                  "chosen" if found["host"] else "declined", what, found["host_median_us"], found["xla_median_us"])
        return found

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("host"), bool)}

    def _write(self, sign: str, decision: dict[str, Any]) -> None:
        """Merge one decision into the file (under the lock; replaced atomically, so a reader never sees half
        a file)."""
        try:
            merged = {**self._read(), sign: decision}
            handle, partial = tempfile.mkstemp(dir=self.path.parent, suffix=".partial")
            with os.fdopen(handle, "w") as stream:
                json.dump(merged, stream, sort_keys=True)
            os.replace(partial, self.path)
        except OSError as error:
            log.debug("tpucompile: host kernel decisions not saved: %s", error)


def _decision(what: str, xla_rounds: list[float], host_rounds: list[float]) -> dict[str, Any]:
    """A stored decision: the verdict (``host_wins``) and the timings behind it."""
    return {"op": what, "host": host_wins(xla_rounds, host_rounds),
            **{f"{name}_{stat}_us": round(fn(rounds) * 1e6, 2)
               for name, rounds in (("xla", xla_rounds), ("host", host_rounds))
               for stat, fn in (("min", min), ("median", statistics.median))}}


@functools.cache
def _decisions() -> _Decisions:
    return _Decisions(decisions_path())


def decisions_path() -> pathlib.Path:
    """The file of this machine's measured decisions: signature → ``{"op", "host", "xla_min_us",
    "xla_median_us", "host_min_us", "host_median_us"}``."""
    digest = hashlib.sha256(_machine().encode()).hexdigest()[:16]
    return library.build_root() / "kernel_choices" / f"{digest}.json"


def host_wins(xla_rounds: list[float], host_rounds: list[float]) -> bool:
    """Whether timings (seconds per call, one per round) send an op to the host kernel (``WIN_RATIO``)."""
    return (min(host_rounds) <= WIN_RATIO * min(xla_rounds)
            and statistics.median(host_rounds) <= statistics.median(xla_rounds))


def time_both(xla_program: str, host_program: str, target: Any) -> tuple[list[float], list[float]]:
    """Seconds per call of the two programs on ``target``, one figure per round, timed in alternating rounds
    on the same random inputs."""
    options = compile_options(target)
    # Each program runs many times on the same inputs, so none may take them over; both are timed as this
    # CPU compiles them (depthwise convolutions written as sums over their taps).
    programs = [target.client.compile_and_load(depthwise.rewrite(_without_donation(p)), target.device_list(), options)
                for p in (xla_program, host_program)]
    for program in programs:  # LAPACK and friends set up, as for any program about to run
        make_ready(program, target.platform)
    with context():
        module = ir.Module.parse(xla_program)  # held: its operations are freed with it
        (function,) = [op for op in module.body.operations
                       if ir.StringAttr(op.attributes["sym_name"]).value == "main"]
        types = [ir.RankedTensorType(t) for t in ir.TypeAttr(function.attributes["function_type"]).value.inputs]
        shapes = [(list(t.shape), str(t.element_type)) for t in types]
    # Real tensors, also while a compile traces with fake ones (Dynamo's and AOTAutograd's fake tensor mode).
    with unset_fake_temporarily():
        generator = torch.Generator().manual_seed(0)
        tensors = [_example(shape, element_type, generator) for shape, element_type in shapes]
        inputs = [to_buffer(tensor, target.device) for tensor in tensors]  # sharing the tensors' memory
    samples: list[list[float]] = [[], []]
    for program in programs:  # a first untimed call of each
        _run(program, inputs)
    for _ in range(_ROUNDS):
        for index, program in enumerate(programs):
            calls, start = 0, time.perf_counter()
            while True:
                _run(program, inputs)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= _ROUND_SECONDS:
                    break
            samples[index].append(elapsed / calls)
    return samples[0], samples[1]


def _without_donation(program: str) -> str:
    """``program`` with no argument donated to a result (the input/output aliasing attributes dropped)."""
    with context():
        module = ir.Module.parse(program)
        for op in module.body.operations:
            if "arg_attrs" not in op.attributes:
                continue
            entries = [{a.name: a.attr for a in ir.DictAttr(e) if a.name != "tf.aliasing_output"}
                       for e in ir.ArrayAttr(op.attributes["arg_attrs"])]
            op.attributes["arg_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get(e) for e in entries])
        return str(module)


def _run(program: Any, inputs: list[Any]) -> None:
    results = program.execute_sharded(inputs).disassemble_into_single_device_arrays()
    for result in results:
        result[0].block_until_ready()


_FLOAT_TYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16}
_OTHER_TYPES = {"i1": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
                "ui8": torch.uint8, "complex<f32>": torch.complex64, "complex<f64>": torch.complex128}


def _example(shape: list[int], element_type: str, generator: torch.Generator) -> torch.Tensor:
    """An input for timing: normal floats; zeros for integers and booleans (valid as indices, offsets and
    seeds, so a whole program runs on them as it would on real data)."""
    if element_type in _FLOAT_TYPES:
        return torch.randn(shape, generator=generator).to(_FLOAT_TYPES[element_type])
    if element_type in _OTHER_TYPES:
        return torch.zeros(shape, dtype=_OTHER_TYPES[element_type])
    raise ValueError(f"no example input of element type {element_type}")
