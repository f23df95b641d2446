"""The host kernels' library: matrix products and convolutions on the CPU through the host's BLAS, called from
XLA programs as FFI custom calls.

``tpucompile_host_gemm`` (``kernels.c``) is a small XLA FFI handler that calls ``sgemm_``/``dgemm_``/
``cblas_gemm_bf16bf16f32`` of the BLAS already loaded with torch, and XLA keeps everything around it.
``tpucompile_host_conv`` in the same library runs f32 2-D convolutions as im2col (or col2im) around
``sgemm_``, sharing a convolution's images out over XLA's intra-op pool (``convolutions`` says which
convolutions it can take). Like JAX's LAPACK kernels, the library takes the BLAS's addresses at start-up
instead of linking it. Inside a program the BLAS runs on the calling thread alone (an OpenMP team forked
there competes with XLA's pool threads for the cores). Whether a given op of a program calls them or stays
with XLA's own dot or convolution is decided per op by timing both (``kernel_choice``): which is faster
depends on the shape, the machine and XLA's release.

The handler is compiled from its C source on first use with the system C compiler (``$CC`` or ``cc``) against
jaxlib's XLA FFI header, into a directory keyed by the source and jaxlib's version, and each kernel is checked
on small products before it is used. Without a compiler, or without the BLAS symbols, programs keep XLA's dots.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jaxlib

log = logging.getLogger("tpucompile")

TARGET_NAME = "tpucompile_host_gemm"
"""The FFI target name programs call for matrix products."""
CONV_TARGET_NAME = "tpucompile_host_conv"
"""The FFI target name programs call for f32 2-D convolutions (im2col + the BLAS's sgemm)."""

_SOURCE = pathlib.Path(__file__).with_name("kernels.c")
_DTYPE_BITS = {"f32": 1, "f64": 2, "bf16": 4}
_BLAS_SYMBOLS = ("sgemm_", "dgemm_", "cblas_gemm_bf16bf16f32", "MKL_Set_Num_Threads_Local")


@functools.cache
def kernels() -> HostBlas | None:
    """The registered host BLAS kernels of this process, or None when they cannot be built or bound (XLA's
    own dots and convolutions are used then). Set ``TPUCOMPILE_HOST_BLAS=0`` to turn them off, or
    ``TPUCOMPILE_HOST_CONV=0`` to keep XLA's convolutions only."""
    if _off("TPUCOMPILE_HOST_BLAS"):
        return None
    try:
        return HostBlas.load()
    except _Unavailable as why:
        log.info("tpucompile: matrix products stay in XLA's CPU emitter: %s", why)
        return None


def _off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


class _Unavailable(Exception):
    """Why the host BLAS kernels cannot be used here."""


class HostBlas:
    """The compiled handler library, bound to the BLAS and registered with XLA under ``TARGET_NAME``."""

    def __init__(self, library: ctypes.CDLL, dtypes: frozenset[str], fingerprint: str, convolutions: bool) -> None:
        self.library = library
        self.dtypes = dtypes
        """The operand dtypes with a kernel ("f32", "f64", "bf16")."""
        self.fingerprint = fingerprint
        """What identifies the code programs call (source, jaxlib, BLAS, whether convolutions are taken): part
        of executable cache keys."""
        self.convolutions = convolutions
        """Whether f32 2-D convolutions call ``CONV_TARGET_NAME`` (``convolutions``)."""

    @classmethod
    def load(cls) -> HostBlas:
        source = _SOURCE.read_bytes()
        blas_path, symbols = _find_blas()
        library = ctypes.CDLL(str(_build(source)))
        gemms, set_local_threads = symbols[:3], symbols[3]
        library.tpucompile_host_blas_threads(ctypes.c_void_p(set_local_threads))
        library.tpucompile_host_blas_bind(*(ctypes.c_void_p(address) for address in gemms))
        # A kernel that disagrees with a plain loop (another integer width, another calling convention) is
        # unbound, so the handler refuses its dtype and the rewrite never emits it.
        agree = library.tpucompile_host_blas_selftest()
        bits = tuple(_DTYPE_BITS.values())
        library.tpucompile_host_blas_bind(
            *(ctypes.c_void_p(address if agree & bit else 0) for address, bit in zip(gemms, bits, strict=True))
        )
        dtypes = frozenset(name for name, bit in _DTYPE_BITS.items() if agree & bit)
        if "f32" not in dtypes:
            raise _Unavailable(f"sgemm_ of {blas_path} is absent or failed a self-check")
        import jax

        jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.tpucompile_host_gemm), platform="cpu")
        jax.ffi.register_ffi_target(CONV_TARGET_NAME, jax.ffi.pycapsule(library.tpucompile_host_conv), platform="cpu")
        blas = hashlib.sha256(f"{pathlib.Path(blas_path).name}:{sorted(dtypes)}".encode()).hexdigest()
        convolutions = not _off("TPUCOMPILE_HOST_CONV")
        identity = source + jaxlib.__version__.encode() + blas.encode() + (b"" if convolutions else b"no-conv")
        return cls(library, dtypes, hashlib.sha256(identity).hexdigest()[:32], convolutions)


def _find_blas() -> tuple[str, tuple[int, ...]]:
    """(library path, addresses of ``_BLAS_SYMBOLS`` (0 where absent)) of the BLAS torch loaded."""
    import torch

    lib_dir = pathlib.Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if path.exists():
            break
    else:
        raise _Unavailable(f"no libtorch_cpu in {lib_dir}")
    library = ctypes.CDLL(str(path))
    addresses = []
    for symbol in _BLAS_SYMBOLS:
        try:
            addresses.append(ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value or 0)
        except AttributeError:
            addresses.append(0)
    if not addresses[0]:
        raise _Unavailable(f"{path.name} exports no sgemm_")
    return str(path), tuple(addresses)


def _build(source: bytes) -> pathlib.Path:
    """The handler library for ``source``, compiled once per source and jaxlib into the build directory."""
    include = pathlib.Path(jaxlib.__file__).parent / "include"
    if not (include / "xla" / "ffi" / "api" / "c_api.h").exists():
        raise _Unavailable(f"jaxlib ships no XLA FFI header under {include}")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C compiler ({compiler!r} is not on PATH)")
    key = hashlib.sha256(source + jaxlib.__version__.encode() + compiler.encode()).hexdigest()[:24]
    directory = build_root() / key
    library = directory / "libtpucompile_host_blas.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Each builder writes its own file and renames it into place: concurrent processes never see half a library.
    handle, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
    os.close(handle)
    command = [compiler, "-O3", "-shared", "-fPIC", "-std=c11", f"-I{include}", "-x", "c", "-", "-o", partial]
    try:
        done = subprocess.run(command, input=source, capture_output=True, timeout=120)
        if done.returncode != 0:
            raise _Unavailable(f"{compiler} failed on {_SOURCE.name}: {done.stderr.decode(errors='replace')[-2000:]}")
        os.replace(partial, library)
    except (OSError, subprocess.SubprocessError) as error:
        raise _Unavailable(f"cannot build {_SOURCE.name}: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def build_root() -> pathlib.Path:
    """``$TPUCOMPILE_BUILD_DIR``, else ``$XDG_CACHE_HOME/tpucompile/build`` or ``~/.cache/tpucompile/build``."""
    explicit = os.environ.get("TPUCOMPILE_BUILD_DIR")
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tpucompile" / "build"
