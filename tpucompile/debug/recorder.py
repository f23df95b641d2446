"""Writing a dump: the ``Recorder`` the driver feeds while it compiles, one folder per graph, and the switch
that turns it on (``start``/``stop``, or ``TPUCOMPILE_DUMP_DIR`` read by the backend). This is the only part
of ``tpucompile.debug`` that runs inside a compile; it never fails one."""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import pathlib
import re
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpucompile.cache import digest
from tpucompile.contracts.input_uses import BUDGET_KEY
from tpucompile.contracts.target_names import generation_of, slug
from tpucompile.debug.layout import ENV_VAR, GRAPH_FOLDER, STAGES
from tpucompile.debug.reader import read_dump
from tpucompile.debug.report import format_summary
from tpucompile.debug.stablehlo_text import asm
from tpucompile.frontend.layer_rolling import ROLLING_KEY

if TYPE_CHECKING:
    import torch.fx

    from tpucompile.driver import CompileEvent

log = logging.getLogger("tpucompile")

_OUR_FILES = ("info.json", "fx.txt", "aten.txt", "stablehlo.mlir")
_NAME = re.compile(r"^graph (?P<dynamo>\d+) \((?P<role>\w+)\)(?: (?P<region>\S+))?$")
_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                 "complex64": "c64", "complex128": "c128"}


class Recorder:
    """Writes one folder per compiled graph under ``root``; keeps the text of the stages it was shown."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = prepare(root)
        self.count = 0
        self._stages: dict[str, list[tuple[str, str]]] = {}
        self._fallback: dict[str, list[str]] = {}
        self._folders: dict[str, pathlib.Path] = {}
        self._lock = threading.Lock()

    def record(self, name: str, stage: str, gm: torch.fx.GraphModule) -> None:
        """Keep ``gm``'s text as it is now: later passes change the graph in place."""
        try:
            text = gm.print_readable(print_output=False)
            notes = gm.meta.get(ROLLING_KEY)
            if notes:  # which layers were rolled into a loop, and why the others were not
                text = "".join(f"# {line}\n" for line in notes) + text
            if stage == "partitioned":
                self._fallback[name] = _eager_ops(gm)
        except Exception as error:  # a dump must never fail a compile
            text = f"(could not print this graph: {type(error).__name__}: {error})\n"
        with self._lock:
            self._stages.setdefault(name, []).append((stage, text))

    def on_compile(self, event: CompileEvent) -> None:
        """Write the folder of the graph ``event`` describes (for a compile-only target, into the folder of
        the graph it was compiled from)."""
        if event.target is not None:
            try:
                with self._lock:
                    first = event.name not in self._folders
                    number = self.count
                    self.count += first
                if first:  # a compile-only run compiles for the targets alone: the graph's folder starts here
                    self._write(number, event)
                self._write_target(event)
            except Exception as error:
                log.warning("tpucompile: could not dump %s for %s to %s: %s: %s", event.name, event.target,
                            self.root, type(error).__name__, error)
            return
        with self._lock:
            number = self.count
            self.count += 1
        try:
            self._write(number, event)
        except Exception as error:  # a full disk or a vanished directory: say so, keep compiling
            log.warning("tpucompile: could not dump %s to %s: %s: %s", event.name, self.root,
                        type(error).__name__, error)

    def _write(self, number: int, event: CompileEvent) -> None:
        match = _NAME.match(event.name)
        role = match["role"] if match else "graph"
        region = match["region"] if match else None
        folder = self.root / (f"{number:03d}-{role}" + (f"-{region}" if region else ""))
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        with self._lock:
            self._folders[event.name] = folder
        errors: dict[str, str] = {}

        def write(name: str, content: str | bytes | Callable[[], str | bytes]) -> None:
            """Write one file; a stage that cannot be produced is named in info.json instead."""
            try:
                data = content() if callable(content) else content
                (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
            except Exception as error:
                errors[name] = f"{type(error).__name__}: {error}"

        fallback: list[str] = []
        aten_index = 0
        for owner, stages in self._stages_of(event.name):
            for stage, text in stages:
                if stage.startswith("fx"):
                    write(f"{stage}.txt", text)
                else:
                    write(f"aten_{aten_index}_{stage}.txt", text)
                    aten_index += 1
            fallback = self._fallback.get(owner, fallback)
        write(STAGES["aten"], lambda: event.graph.print_readable(print_output=False))
        locations, files = _locations(event.graph)
        write("locations.txt", lambda: locations)
        module = event.program.module
        write(STAGES["stablehlo"], lambda: asm(module, locations=True))
        version = _portable_version()
        write("stablehlo.mlirbc", lambda: _bytecode(event.program, version))
        write(STAGES["hlo"], lambda: _runtime().unoptimized_hlo(event.program.bytecode()))
        if event.executable is not None:
            write(STAGES["optimized"], lambda: _runtime().optimized_hlo(event.executable))
        write("compile_options.txt", lambda: _compile_options_text(event.key_components))
        write("key.json", lambda: _json({"key": event.key, "components": event.key_components}))
        info = {
            "graph": number,
            "folder": folder.name,
            "name": event.name,
            "role": role,
            "region": region,
            "dynamo_graph": int(match["dynamo"]) if match else None,
            "aten_ops": len(_ops(event.graph)),
            "hlo_ops": _count_ops(module),
            "inputs": [_spec(s) for s in event.program.input_specs],
            "outputs": [_spec(s) for s in event.program.result_specs],
            "key": event.key,
            "compile_ms": round(event.compile_seconds * 1e3, 3),
            "cache": "hit" if event.cache_hit else "miss",
            "cache_tier": event.tier,
            "lowering": f"from the {event.program_tier} cache" if event.program_tier else "lowered now",
            "fallback_ops": fallback,
            "saved_for_backward": event.saved_for_backward(),
            "uses_per_chip": _uses(event.graph),
            "activation_budget": None if event.graph is None else event.graph.meta.get(BUDGET_KEY),
            "source_files": files,
            "stablehlo_version": version,
            "errors": errors,
        }
        (folder / "info.json").write_text(_json(info))
        (self.root / "summary.txt").write_text(format_summary(read_dump(self.root)) + "\n")

    def _stages_of(self, name: str) -> list[tuple[str, list[tuple[str, str]]]]:
        """Stages recorded for ``name`` and for the graphs it came from ("graph 0" → "graph 0 (forward)" →
        "graph 0 (forward) fused_0"), outermost first."""
        with self._lock:
            return sorted(
                ((owner, list(stages)) for owner, stages in self._stages.items()
                 if name == owner or name.startswith(owner + " ")),
                key=lambda item: len(item[0]),
            )

    def _write_target(self, event: CompileEvent) -> None:
        """``targets/<target>/`` of the graph's folder, and the target's line in its ``info.json``."""
        with self._lock:
            folder = self._folders.get(event.name)
        if folder is None:
            return
        where = folder / "targets" / slug(event.target)
        where.mkdir(parents=True, exist_ok=True)
        errors: dict[str, str] = {}

        def write(name: str, content: Callable[[], str]) -> None:
            try:
                (where / name).write_text(content())
            except Exception as error:
                errors[name] = f"{type(error).__name__}: {error}"

        write(STAGES["stablehlo"], lambda: asm(event.program.module, locations=True))
        if event.executable is not None:
            write(STAGES["optimized"], lambda: _runtime().optimized_hlo(event.executable))
        if event.key_components:
            write("compile_options.txt", lambda: _compile_options_text(event.key_components, event.target))
            write("key.json", lambda: _json({"key": event.key, "components": event.key_components}))
        report = {
            "target": event.target,
            "key": event.key,
            "compile_ms": round(event.compile_seconds * 1e3, 3),
            "cache": "hit" if event.cache_hit else ("failed" if event.error else "miss"),
            "cache_tier": event.tier,
            **(event.report or {}),
            "hbm_bytes": _hbm_bytes(event.key_components.get("device_kind")),
            "fits": None if event.error and not event.out_of_memory else not event.out_of_memory,
            "error": event.error,
            "errors": errors,
        }
        (where / "report.json").write_text(_json(report))
        with self._lock:
            info_file = folder / "info.json"
            info = json.loads(info_file.read_text())
            info.setdefault("targets", {})[event.target] = report
            info_file.write_text(_json(info))
            (self.root / "summary.txt").write_text(format_summary(read_dump(self.root)) + "\n")


_active: Recorder | None = None
_remove_observer: Callable[[], None] | None = None
_environment_failed = False


def active() -> bool:
    """Whether a dump is recording (warm starts then take the path that shows every stage)."""
    return _active is not None


def start(root: str | os.PathLike[str]) -> Recorder:
    """Dump every graph compiled from now on to ``root`` (replacing an earlier dump there); the active
    recorder when one is running already. Raises ``OSError`` when ``root`` is not a writable directory."""
    global _active, _remove_observer
    if _active is not None:
        return _active
    from tpucompile import driver

    recorder = Recorder(root)
    driver.set_graph_recorder(recorder.record)
    _remove_observer = driver.add_observer(recorder.on_compile)
    _active = recorder
    return recorder


def stop() -> None:
    """Stop dumping; the folders written stay."""
    global _active, _remove_observer
    from tpucompile import driver

    if _remove_observer is not None:
        _remove_observer()
    driver.set_graph_recorder(None)
    _active, _remove_observer = None, None


def start_from_environment() -> None:
    """Start dumping to ``$TPUCOMPILE_DUMP_DIR`` when it is set (the backend calls this on every graph).

    An unusable directory is reported once and the program runs on without a dump.
    """
    global _environment_failed
    root = os.environ.get(ENV_VAR)
    if not root or _active is not None or _environment_failed:
        return
    try:
        start(root)
    except OSError as error:
        _environment_failed = True
        log.warning("tpucompile: %s=%s is not a writable directory (%s); not dumping", ENV_VAR, root, error)


def prepare(root: str | os.PathLike[str]) -> pathlib.Path:
    """Create ``root`` and remove an earlier dump's folders from it (nothing else); raises ``OSError`` when
    it cannot be written."""
    path = pathlib.Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".tpucompile-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
    for child in path.iterdir():
        if child.is_dir() and GRAPH_FOLDER.match(child.name) and any((child / f).exists() for f in _OUR_FILES):
            shutil.rmtree(child)
    (path / "summary.txt").unlink(missing_ok=True)
    return path


def _eager_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The ATen ops a partitioned graph runs in eager PyTorch (its compiled regions are submodule calls)."""
    from tpucompile import diagnostics

    ops = {diagnostics.op_name(n.target) for n in gm.graph.nodes
           if n.op == "call_function" and hasattr(n.target, "_schema")}
    return sorted(ops)


def _ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's op nodes (a ``getitem`` only picks one result of another op)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _locations(gm: torch.fx.GraphModule) -> tuple[str, list[str]]:
    """One line per op (node, op, where the user's code calls it) and the source files named."""
    from tpucompile import diagnostics

    lines, files = [], set()
    for node in _ops(gm):
        where = diagnostics.source_location(node)
        if where is not None:
            files.add(where.file)
        lines.append(f"{node.name}  {diagnostics.op_name(node.target)}  {where or '(no source location)'}")
    return "\n".join(lines) + "\n", sorted(files)


def _count_ops(module: Any) -> int:
    """StableHLO/CHLO operations in the module, nested ones included, region terminators not."""

    def count(operation: Any) -> int:
        total = 0
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    name = op.operation.name
                    if name.startswith(("stablehlo.", "chlo.")) and name != "stablehlo.return":
                        total += 1
                    total += count(op.operation)
        return total

    with module.context:
        return count(module.operation)


@functools.cache
def _portable_version() -> str:
    from jax.extend.mlir.dialects import stablehlo

    return stablehlo.get_current_version()


def _bytecode(program: Any, version: str) -> bytes:
    """A portable StableHLO artifact; plain MLIR bytecode for sharded programs, since the portable format has
    no Shardy (``sdy``) dialect."""
    text = program.text(debug_info=True)
    if "sdy." in text:
        return program.bytecode()
    return _portable_artifact(text, version)


def _portable_artifact(text: str, version: str) -> bytes:
    from jax.extend.mlir.dialects import stablehlo

    return stablehlo.serialize_portable_artifact_str(text, version)  # from text: the module stays as it is


def _runtime() -> Any:
    from tpucompile import runtime

    return runtime


def _compile_options_text(components: dict[str, Any], target: str | None = None) -> str:
    runtime = _runtime()
    if target is not None:
        from tpucompile.runtime.targets.compile_only import compile_targets, spanning

        (chosen,) = compile_targets((target,))
        options = runtime.compile_options(spanning(chosen, int(components.get("device_count") or 1)))
    else:
        options = runtime.compile_options(runtime.get_target(components.get("platform")))
    fingerprint = digest(runtime.compile_options_fingerprint(options))
    header = (f"# sha256 of these options without debug fields: {fingerprint} (the key's compile_options)\n"
              f"# XLA_FLAGS that change code: {' '.join(runtime.build_flags()) or '(none)'}\n")
    return header + runtime.describe_compile_options(options)


def _spec(spec: Any) -> str:
    dtype = str(spec.dtype).removeprefix("torch.")
    return f"{_SHORT_DTYPES.get(dtype, dtype)}[{','.join(str(s) for s in spec.shape)}]"


def _json(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True, default=str) + "\n"


def _uses(gm: torch.fx.GraphModule | None) -> dict[str, int] | None:
    from tpucompile.debug.uses import graph_uses  # torch: only where graphs compile, not where dumps are read

    try:
        return None if gm is None else graph_uses(gm)
    except Exception as error:  # a report figure, never a failed dump
        log.warning("tpucompile: could not count the graph's bytes by use: %s: %s", type(error).__name__, error)
        return None


def _hbm_bytes(device_kind: Any) -> int | None:
    generation = generation_of(device_kind)
    return generation.hbm_bytes if generation else None
