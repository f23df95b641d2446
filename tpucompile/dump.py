"""Dumps of what each compiled graph became: ``tpucompile dump-hlo`` and ``TPUCOMPILE_DUMP_DIR``.

While a dump is active, every graph the backend compiles gets a folder ``DIR/NNN-ROLE`` (numbered in compile
order; ROLE is forward, backward or inference, followed by the region for a partitioned graph) holding:

    fx.txt                     Dynamo's FX graph, as the backend received it
    fx_rewrite_attention.txt   the same after attention was routed to its math form (when it was)
    fx_rewrite_interpolation.txt  the same after bilinear resampling became matrix products (when it did)
    aten_N_<stage>.txt         the ATen graph from AOTAutograd, then after each pass
    aten.txt                   the ATen graph that was lowered
    locations.txt              each ATen op and the user's source line it came from
    stablehlo.mlir             StableHLO text; each op carries loc("file.py":line:col) of the user's source
    stablehlo.mlirbc           the same as a portable StableHLO artifact (versioned VHLO bytecode; MLIR
                               bytecode for sharded programs, which the portable format cannot hold)
    hlo.txt                    XLA HLO as XLA's passes first see it
    hlo_optimized.txt          XLA HLO of the compiled executable, after optimisation
    compile_options.txt        the XLA compile options
    key.json                   the executable's cache key and its components
    info.json                  op counts, signature, compile time, cache outcome, fallback ops, source files
    targets/<target>/          per compile-only target (``--target tpu:v5e:2x2``): the StableHLO it was
                               lowered to, its optimised HLO, compile options, key and report.json (memory
                               per chip by use, flops, whether it fits, or why it does not compile)

Recording happens in the compiling process, through ``driver.set_graph_recorder`` and ``driver.add_observer``;
it never fails a compile (a stage that cannot be written is named in ``info.json``). Reading a dump (the
summary table, one stage of one graph, the StableHLO of a cache entry) imports neither torch nor the
compiler, so the command line answers quickly.
"""

from __future__ import annotations

import dataclasses
import difflib
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

from tpucompile.cache import PersistentCache, differing_components, digest
from tpucompile.cache.keys import is_key
from tpucompile.targets import GENERATIONS, slug

if TYPE_CHECKING:
    import torch.fx

    from tpucompile.driver import CompileEvent

log = logging.getLogger("tpucompile")

ENV_VAR = "TPUCOMPILE_DUMP_DIR"
DEFAULT_DIR = "tpucompile_dump"
STAGES = {
    "fx": "fx.txt",
    "aten": "aten.txt",
    "stablehlo": "stablehlo.mlir",
    "hlo": "hlo.txt",
    "optimized": "hlo_optimized.txt",
}
"""``--stage`` name → the file holding that stage in a graph's folder."""

_FOLDER = re.compile(r"^\d{3,}-[a-z]")
_OUR_FILES = ("info.json", "fx.txt", "aten.txt", "stablehlo.mlir")
_NAME = re.compile(r"^graph (?P<dynamo>\d+) \((?P<role>\w+)\)(?: (?P<region>\S+))?$")
_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                 "complex64": "c64", "complex128": "c128"}


# -- recording ------------------------------------------------------------------------------------------


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
        write(STAGES["stablehlo"], lambda: _asm(module, locations=True))
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

        write(STAGES["stablehlo"], lambda: _asm(event.program.module, locations=True))
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
        if child.is_dir() and _FOLDER.match(child.name) and any((child / f).exists() for f in _OUR_FILES):
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


def _asm(module: Any, locations: bool) -> str:
    """Module text; with ``locations`` each op's location is written inline, so a line is greppable."""
    return module.operation.get_asm(enable_debug_info=locations, use_local_scope=locations)


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
        from tpucompile.runtime.topology import compile_targets, spanning

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


# -- reading --------------------------------------------------------------------------------------------


def read_dump(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``info.json`` of every graph in the dump at ``root``, in compile order (empty when none)."""
    path = pathlib.Path(root)
    infos = []
    if path.is_dir():
        for child in path.iterdir():
            info_file = child / "info.json"
            if child.is_dir() and _FOLDER.match(child.name) and info_file.is_file():
                try:
                    infos.append(json.loads(info_file.read_text()))
                except (OSError, ValueError):
                    continue
    return sorted(infos, key=lambda info: info["graph"])


def stage_text(root: str | os.PathLike[str], graph: int, stage: str, target: str | None = None) -> str:
    """The text of one stage of graph number ``graph`` (as compiled for compile-only ``target``, when one is
    named); ``LookupError`` saying why when there is none."""
    infos = {info["graph"]: info for info in read_dump(root)}
    if graph not in infos:
        have = f"graphs 0-{max(infos)}" if infos else "no graphs"
        raise LookupError(f"no graph {graph} in the dump at {root} ({have})")
    info = infos[graph]
    name = STAGES[stage]
    path = pathlib.Path(root) / info["folder"] / name
    errors = info.get("errors", {})
    if target is not None:
        report = info.get("targets", {}).get(target)
        if report is None:
            have = ", ".join(info.get("targets", {})) or "none"
            raise LookupError(f"graph {graph} was not compiled for {target} (targets in this dump: {have})")
        if stage not in ("stablehlo", "optimized"):
            raise LookupError("for a compile-only target the dump keeps the stablehlo and optimized stages")
        path = pathlib.Path(root) / info["folder"] / "targets" / slug(target) / name
        errors = {**report.get("errors", {}), **({name: report["error"]} if report.get("error") else {})}
    if not path.is_file():
        why = errors.get(name, "not recorded for this graph")
        raise LookupError(f"graph {graph} has no {stage} stage{' for ' + target if target else ''}: {why}")
    return path.read_text()


def format_summary(infos: list[dict[str, Any]]) -> str:
    """One row per graph: what it is, how big, what it takes and returns, its key and how it was compiled."""
    header = ["graph", "role", "aten ops", "hlo ops", "in/out", "shapes", "key", "compile ms", "cache", "fallback"]
    rows = [header]
    for info in infos:
        role = info["role"] + (f" {info['region']}" if info.get("region") else "")
        cache = info["cache"] + (f" ({info['cache_tier']})" if info.get("cache_tier") else "")
        rows.append([
            str(info["graph"]), role, str(info["aten_ops"]), str(info["hlo_ops"]),
            f"{len(info['inputs'])}/{len(info['outputs'])}",
            f"{_clip_shapes(info['inputs'])} -> {_clip_shapes(info['outputs'])}", info["key"][:12],
            f"{info['compile_ms']:.1f}", cache, ",".join(info.get("fallback_ops") or []) or "-",
        ])
    return "\n".join([_table(rows, {0, 2, 3, 7}), *_target_summaries(infos)])


def _table(rows: list[list[str]], numeric: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _target_summaries(infos: list[dict[str, Any]]) -> list[str]:
    """Per compile-only target: each graph's memory per chip by use, flops and whether it fits the chip,
    then why any graph does not compile for it."""
    names = list(dict.fromkeys(t for info in infos for t in info.get("targets", {})))
    blocks = []
    for name in names:
        reports = [(info, info["targets"][name]) for info in infos if name in info.get("targets", {})]
        hbm = next((r["hbm_bytes"] for _, r in reports if r.get("hbm_bytes")), None)
        title = f"{name}: memory per chip" + (f" (of {hbm / 2**30:.2f} GiB HBM)" if hbm else "")
        rows = [["graph", "role", "arguments", "outputs", "temporaries", "code", "peak", "flops", "fits",
                 "compile ms", "cache"]]
        failures = []
        for info, report in reports:
            memory = report.get("memory") or {}
            role = info["role"] + (f" {info['region']}" if info.get("region") else "")
            cells = [_bytes(memory.get(k)) for k in ("argument", "output", "temp", "generated_code", "peak")]
            rows.append([str(info["graph"]), role, *cells, _count(report.get("flops")),
                         _fits(report, memory.get("peak"), hbm), f"{report.get('compile_ms', 0):.1f}",
                         report.get("cache", "-") + (f" ({report['cache_tier']})" if report.get("cache_tier") else "")])
            if report.get("error"):
                failures.append(f"  graph {info['graph']}: {report['error']}")
        blocks.append("\n".join([title, _table(rows, {0, 2, 3, 4, 5, 6, 7, 9}), *failures]))
    return ["", *blocks] if blocks else []


def _fits(report: dict[str, Any], peak: int | None, hbm: int | None) -> str:
    if report.get("fits") is False:
        return "NO"
    if report.get("error"):
        return "-"
    if peak and hbm:
        share = 100 * peak / hbm
        return ("NO" if share > 100 else f"yes ({share:.1f}%)" if share >= 0.1 else "yes (<0.1%)")
    return "yes"


def _bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f}"


def _hbm_bytes(device_kind: Any) -> int | None:
    return next((g.hbm_bytes for g in GENERATIONS.values() if g.device_kind == device_kind), None)


def _clip_shapes(specs: list[str], shown: int = 1) -> str:
    if not specs:
        return "()"
    text = " ".join(specs[:shown])
    return text + (f" +{len(specs) - shown}" if len(specs) > shown else "")


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """The StableHLO stored under a key, and where it was found."""

    key: str
    text: str
    """Module text with inline source locations."""
    components: dict[str, Any] | None
    source: str


def stored_program(key: str, cache: PersistentCache | None, root: str | os.PathLike[str]) -> StoredProgram:
    """The StableHLO of a cache entry (a program entry, or the program an executable entry was compiled
    from) or of a dumped graph, by full key or unique prefix; ``LookupError`` saying why when there is none."""
    prefix = key.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise LookupError(f"{key!r} is not a cache key (keys are hex digits)")
    if cache is not None:
        found = _from_cache(prefix, cache)
        if found is not None:
            return found
    dumped = [info for info in read_dump(root) if info["key"].startswith(prefix)]
    if len({info["key"] for info in dumped}) > 1:
        raise LookupError(f"{key} matches {len({i['key'] for i in dumped})} dumped graphs; give more of the key")
    if dumped:
        folder = pathlib.Path(root) / dumped[0]["folder"]
        components = json.loads((folder / "key.json").read_text())["components"]
        text = (folder / STAGES["stablehlo"]).read_text()
        return StoredProgram(dumped[0]["key"], text, components, f"dump {folder}")
    where = f"cache {cache.local.root}" if cache is not None else "no cache"
    raise LookupError(f"no cache entry or dumped graph has key {key} ({where}, dump {root})")


def _from_cache(prefix: str, cache: PersistentCache) -> StoredProgram | None:
    keys = [prefix] if is_key(prefix) else [k for k in cache.local.list_keys() if k.startswith(prefix)]
    if len(keys) > 1:
        raise LookupError(f"{prefix} matches {len(keys)} cache entries; give more of the key")
    found = cache.get(keys[0]) if keys else None
    if found is None:
        return None
    entry = found[0]
    if entry.kind == "program":
        return StoredProgram(entry.key, module_text(entry.payload), entry.components, f"cache {cache.local.root}")
    program_digest = entry.components.get("program")
    for row in cache.index.rows():
        if row["kind"] != "program":
            continue
        candidate = cache.get(row["key"])
        if candidate is not None and candidate[0].metadata.get("program_sha256") == program_digest:
            return StoredProgram(entry.key, module_text(candidate[0].payload), entry.components,
                                 f"cache {cache.local.root}")
    raise LookupError(f"cache entry {entry.key[:16]} is an executable whose StableHLO is not stored "
                      "(no program entry was made for it)")


def module_text(module: bytes | str, locations: bool = True) -> str:
    """Parse StableHLO (text or MLIR bytecode) and print it, with inline locations or without any."""
    from jax.extend.mlir import ir

    with _mlir_context():
        return _asm(ir.Module.parse(module), locations)


@functools.cache
def _mlir_context() -> Any:
    from jax.interpreters import mlir as jax_mlir

    return jax_mlir.make_ir_context()


def diff_programs(first: StoredProgram, second: StoredProgram) -> str:
    """A unified diff of two programs' StableHLO without locations (what their keys hash), or a line saying
    they are the same and which other key components differ."""
    a = module_text(first.text, locations=False).splitlines(keepends=True)
    b = module_text(second.text, locations=False).splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(a, b, fromfile=first.key[:16], tofile=second.key[:16]))
    if diff:
        return diff
    differing = differing_components(first.components or {}, second.components or {})
    reason = f"; the keys differ in: {', '.join(differing)}" if differing else ""
    return f"{first.key[:16]} and {second.key[:16]} have the same StableHLO{reason}\n"
