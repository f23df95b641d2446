"""libtpu, the TPU compiler and runtime that jax loads as a PJRT plugin: whether the version jax needs is
installed, and how to load it on a machine without a TPU.

Three things go wrong there without care. libtpu takes ``/tmp/libtpu_lockfile`` when it loads, so a second
process on the machine (a test runner's child, a parallel build) cannot load it: on a machine with no TPU chip
there is nothing to protect, and ``ALLOW_MULTIPLE_LIBTPU_LOAD`` lifts the lock. libtpu also writes warnings
about ``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES`` to the process's stderr when it finds no TPU host
around it, every time jax starts its backends; they mean nothing for compiling, and ``quiet()`` drops exactly
those lines. Finally, libtpu is built for one jaxlib: another version is refused with the one to install.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from tpucompile.errors import OptionsError

INSTALL_HINT = 'pip install "tpucompile[tpu]"'

_NOISE = re.compile(
    r"TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|Logging before InitGoogle\(\) is written to STDERR"
    r"|^=== Source Location Trace: ===\s*$|libtpu_init_utils\.cc:\d+\s*$"
)


def required_version() -> str | None:
    """The libtpu requirement of the installed jax's ``tpu`` extra (e.g. ``==0.0.42.*``), None if it has none."""
    try:
        requirements = importlib.metadata.requires("jax") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        text, _, marker = requirement.partition(";")
        match = re.match(r"^\s*libtpu\s*(\[[^\]]*\])?\s*(?P<spec>[^;]*)$", text)
        if match and re.search(r"extra\s*==\s*['\"]tpu['\"]", marker):
            return match["spec"].strip() or None
    return None


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed(target: str) -> None:
    """Refuse to compile for ``target`` unless the libtpu that the installed jax asks for is there."""
    wanted = required_version()
    pin = f'libtpu{wanted}' if wanted else "libtpu"
    jax_version = _version("jax")
    have = installed_version()
    if have is None:
        raise OptionsError(
            f"compiling for {target} needs libtpu, which is not installed: {INSTALL_HINT} "
            f"(or pip install \"{pin}\", the version jax {jax_version} asks for)"
        )
    if wanted and not _satisfies(have, wanted):
        raise OptionsError(
            f"compiling for {target} needs the libtpu built for jax {jax_version} / jaxlib {_version('jaxlib')} "
            f"(\"{pin}\"), but libtpu {have} is installed: pip install \"{pin}\" (or {INSTALL_HINT})"
        )


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _satisfies(version: str, specifier: str) -> bool:
    """``==X.Y.*`` and ``==X.Y.Z`` pins (what jax's extra uses); anything else is left to pip."""
    match = re.fullmatch(r"==\s*([0-9A-Za-z.]+?)(\.\*)?", specifier.strip())
    if match is None:
        return True
    pinned, wildcard = match.group(1), match.group(2)
    return version.startswith(pinned + ".") or version == pinned if wildcard else version == pinned


def has_tpu_chips() -> bool:
    """Whether this machine may have TPU chips (jax's own check of the PCI bus; True when it cannot tell, so
    that libtpu's lock keeps guarding them)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:
        return True


def allow_shared_load() -> None:
    """On a machine without TPU chips, let every process load libtpu at once (there is no chip to guard).
    Call before jax starts its backends; a machine with TPUs keeps libtpu's lock."""
    if "ALLOW_MULTIPLE_LIBTPU_LOAD" not in os.environ and not has_tpu_chips():
        os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop libtpu's start-up warnings about a missing TPU host from stderr; everything else written to
    stderr meanwhile is passed on unchanged."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as capture:
        try:
            saved = os.dup(2)
            os.dup2(capture.fileno(), 2)
        except OSError:  # no usable descriptors: let it through
            yield
            return
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                    if not _NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
