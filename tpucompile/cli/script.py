"""Running the user's script in this process (so that its compiles can be observed), with the command's
settings (``--dir``, ``--target``) in force only while it runs: they are handed to the backend through
``config.environment_overrides``, never by writing to ``os.environ``."""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator, Sequence

from tpucompile.cli.common import options, target_names
from tpucompile.config import effective_environ, environment_overrides


@contextlib.contextmanager
def script_settings(args: argparse.Namespace, **overrides: str) -> Iterator[list[str]]:
    """Within the block, every graph compiled uses ``--dir`` as its cache directory, is also compiled for
    each ``--target`` (added to ``TPUCOMPILE_TARGETS``), and sees ``overrides`` (option name → the text of
    its ``TPUCOMPILE_<NAME>`` variable). The targets are checked first: a missing libtpu or an unknown
    topology fails before the script runs. With targets, the process caps glibc's heap arenas
    (``host_memory``). Host kernels are chosen before each compile (``host_kernel_timing="inline"``) unless the
    environment says otherwise. Yields the target names."""
    if args.dir:
        overrides["cache_dir"] = args.dir
    if "TPUCOMPILE_HOST_KERNEL_TIMING" not in effective_environ():
        # What these commands compile is what a later process loads (or what the dump shows): the host-kernel
        # choice is made before each compile, not on calls a short script may never make.
        overrides["host_kernel_timing"] = "inline"
    names = target_names(args)
    if names:
        from tpucompile.runtime.host_memory import limit_heap_arenas
        from tpucompile.runtime.targets.compile_only import compile_targets

        limit_heap_arenas()  # this process is the command's: a large target compile peaks ~1 GiB lower

        compile_targets(tuple(names), options(args).platform)
        present = [n for n in effective_environ().get("TPUCOMPILE_TARGETS", "").split(",") if n.strip()]
        overrides["targets"] = ",".join(dict.fromkeys([*present, *names]))
    with environment_overrides(**overrides):
        yield names


def run_script(script: str, script_args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` in this process (so that its compiles can be observed); returns the
    status it exited with. Exceptions it raises propagate."""
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)  # paths given on the command line stay valid after the run
    return 0


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what the script prints to stderr (file descriptor and all), so stdout carries only the dump."""
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no usable descriptors (an embedded interpreter): redirect Python's writes only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def print_script_traceback(error: BaseException, script: str) -> None:
    """The script's traceback from its own first frame on (runpy and this command are not the user's)."""
    tb = error.__traceback__
    path = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb, file=sys.stderr)
