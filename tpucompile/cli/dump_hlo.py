"""``tpucompile dump-hlo``: run a script with a dump active and print its summary table; print one stage of
one graph of the last dump; print the StableHLO stored under a cache key, or diff two (why did it
recompile?). Each way it can go wrong has its own exit status."""

from __future__ import annotations

import argparse
import os
import sys

from tpucompile.cache import PersistentCache, default_root
from tpucompile.cli.common import Failure, emit, options, progress_lines, target_names
from tpucompile.cli.script import print_script_traceback, run_script, script_settings, stdout_to_stderr
from tpucompile.debug import programs, reader, recorder
from tpucompile.debug.layout import STAGES
from tpucompile.debug.report import format_summary

# Exit statuses of ``dump-hlo`` (besides 0, 1 for other errors and 2 for a malformed command line).
EXIT_NO_SCRIPT = 3
EXIT_SCRIPT_FAILED = 4
EXIT_NOTHING_COMPILED = 5
EXIT_UNKNOWN_KEY = 6
EXIT_OUT_NOT_WRITABLE = 7
EXIT_NO_SUCH_GRAPH = 8
EXIT_TARGET_FAILED = 9


def dump_hlo(args: argparse.Namespace) -> int:
    """Read stored programs (``--key``, ``--diff``), or run the script (when given) and print the dump."""
    if (args.key or args.diff) and (args.script or args.graph is not None):
        raise Failure(2, "--key and --diff read stored programs; they take no script and no --graph")
    if args.key or args.diff:
        return _dump_keys(args)
    if args.script:
        _dump_script(args)
    targets = target_names(args)
    if args.graph is not None:
        if len(targets) > 1:
            raise Failure(2, "--graph prints one stage of one target: give at most one --target")
        try:
            sys.stdout.write(reader.stage_text(args.out, args.graph, args.stage or "stablehlo",
                                               targets[0] if targets else None))
        except LookupError as error:
            raise Failure(EXIT_NO_SUCH_GRAPH, str(error)) from None
        return 0
    infos = reader.read_dump(args.out)
    if not infos:
        raise Failure(EXIT_NO_SUCH_GRAPH, f"no dump in {args.out} (make one with: tpucompile dump-hlo SCRIPT.py)")
    text = (f"{len(infos)} graph{'s' if len(infos) != 1 else ''} dumped to {args.out} "
            f"(--stage {'|'.join(STAGES)} --graph N prints one)\n{format_summary(infos)}")
    emit(args, {"dir": args.out, "graphs": infos}, text)
    failed = [(info, name, report) for info in infos for name, report in info.get("targets", {}).items()
              if report.get("error") and (not targets or name in targets)]
    if failed:
        info, name, report = failed[0]
        more = f" (and {len(failed) - 1} more, listed above)" if len(failed) > 1 else ""
        verb = "does not fit" if report.get("fits") is False else "does not compile for"
        raise Failure(EXIT_TARGET_FAILED, f"graph {info['graph']} ({info['role']}) {verb} {name}{more}: "
                                          f"{report['error']}")
    return 0


def _dump_script(args: argparse.Namespace) -> None:
    """Run the script with a dump active, and fail with the matching status when that went wrong."""
    script = args.script
    if not os.path.isfile(script):
        raise Failure(EXIT_NO_SCRIPT, f"no such script: {script}")
    with script_settings(args):
        try:
            recording = recorder.start(args.out)
        except OSError as error:
            raise Failure(EXIT_OUT_NOT_WRITABLE, f"cannot write the dump to {args.out}: "
                                                 f"{error.strerror or error}") from None
        progress, remove = progress_lines(args), None
        if progress is not None:
            from tpucompile import driver  # the script compiles in this process: torch is loaded anyway

            remove = driver.add_observer(progress)
        try:
            with stdout_to_stderr():
                status = run_script(script, args.script_args)
        except Exception as error:
            print_script_traceback(error, script)
            raise Failure(EXIT_SCRIPT_FAILED, f"{script} raised {type(error).__name__}: {_first_line(error)}; "
                                              f"{_kept(recording.count, args.out)}") from None
        finally:
            recorder.stop()
            if remove is not None:
                remove()
    if status:
        raise Failure(EXIT_SCRIPT_FAILED, f"{script} exited with status {status}; "
                                          f"{_kept(recording.count, args.out)}")
    if recording.count == 0:
        raise Failure(EXIT_NOTHING_COMPILED, f"{script} compiled nothing with backend=\"tpucompile\": "
                                             "no graph to dump")


def _kept(count: int, out: str) -> str:
    return f"{count} graph{'s' if count != 1 else ''} dumped before that, kept in {out}"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _dump_keys(args: argparse.Namespace) -> int:
    """``--key``: one stored program; ``--diff``: how two differ."""
    settings = options(args)
    root = settings.cache_dir or str(default_root())
    cache = PersistentCache(root, mode="read-only", remote=settings.cache_remote,
                            remote_timeout=float(settings.cache_remote_timeout))
    try:
        found = [programs.stored_program(key, cache, args.out) for key in (args.diff or [args.key])]
    except LookupError as error:
        raise Failure(EXIT_UNKNOWN_KEY, str(error)) from None
    if args.key:
        (program,) = found
        emit(args, {"key": program.key, "source": program.source, "stablehlo": program.text}, program.text.rstrip())
        return 0
    diff = programs.diff_programs(*found)
    emit(args, {"a": found[0].key, "b": found[1].key, "diff": diff}, diff.rstrip())
    return 0
