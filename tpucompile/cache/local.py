"""The local directory tier: one immutable file per entry, published atomically.

    <root>/v1/entries/<key[:2]>/<key>   published entries (never rewritten)
    <root>/v1/tmp/                      entries being written (a killed writer leaves only a temp file here)
    <root>/v1/quarantine/               entries that failed verification, moved aside for inspection
    <root>/v1/locks/                    single-flight lock and lease files
    <root>/v1/index.sqlite              hits, sizes and compile times (see ``index.py``)

A writer writes a temp file in the same filesystem, fsyncs it and hard-links it into place: ``os.link``
fails if the entry exists, so publishing is create-only and a reader sees either no file or a whole one.
Where hard links are not supported, ``os.replace`` is used (still atomic; equal keys hold equivalent
entries). This module moves bytes; verifying them is the caller's job (``entry.decode``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import tempfile
import time
import uuid
from collections.abc import Iterator

from tpucompile.cache.keys import is_key

LAYOUT = "v1"


def default_root(environ: os._Environ | dict[str, str] | None = None) -> pathlib.Path:
    """``$XDG_CACHE_HOME/tpucompile``, else ``~/.cache/tpucompile``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tpucompile"


class LocalStore:
    """Entries as files under ``root``; thread- and process-safe without locks."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        self.root = pathlib.Path(root).expanduser()
        self.base = self.root / LAYOUT
        self.entries = self.base / "entries"
        self.tmp = self.base / "tmp"
        self.quarantine_dir = self.base / "quarantine"
        self.locks = self.base / "locks"
        if create:
            for folder in (self.entries, self.tmp, self.quarantine_dir, self.locks):
                folder.mkdir(parents=True, exist_ok=True)

    def write_error(self) -> OSError | None:
        """Why this process cannot create files here (a read-only mode or mount, another owner), or None when
        it can: a temp file is created and removed in each folder that writers create files in."""
        for folder in (self.tmp, self.locks):
            try:
                fd, temp = tempfile.mkstemp(dir=folder, prefix="probe.", suffix=".tmp")
            except OSError as error:
                return error
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
        return None

    def path(self, key: str) -> pathlib.Path:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key[:2] / key

    def read(self, key: str) -> bytes | None:
        """The stored bytes of ``key``, or None when there is no such entry."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    def publish(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless an entry exists; True when this call published it."""
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            return False
        fd, temp = tempfile.mkstemp(dir=self.tmp, prefix=f"{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as stream:
                os.fchmod(stream.fileno(), 0o644)  # mkstemp's 0600 would hide entries from a shared cache's users
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            try:
                os.link(temp, final)
                published = True
            except FileExistsError:
                published = False
            except OSError as error:
                if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                    raise
                published = not final.exists()
                if published:
                    os.replace(temp, final)
            _fsync_dir(final.parent)
            return published
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    def quarantine(self, key: str, reason: str) -> pathlib.Path | None:
        """Move ``key``'s entry aside (with a note saying why); None if it was gone already."""
        source = self.path(key)
        target = self.quarantine_dir / f"{key}.{time.strftime('%Y%m%dT%H%M%S')}.{uuid.uuid4().hex[:8]}"
        try:
            os.replace(source, target)
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            target.with_suffix(target.suffix + ".why").write_text(reason + "\n")
        return target

    def delete(self, key: str) -> int:
        """Remove ``key``'s entry; the bytes freed (0 if it was gone)."""
        path = self.path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return None

    def list_keys(self) -> Iterator[str]:
        """Every published key (in no particular order)."""
        if not self.entries.exists():
            return
        for shard in self.entries.iterdir():
            if shard.is_dir():
                for path in shard.iterdir():
                    if is_key(path.name):
                        yield path.name

    def read_head(self, key: str, size: int = 64 * 1024) -> bytes | None:
        """The first ``size`` bytes of an entry (enough for its header)."""
        try:
            with open(self.path(key), "rb") as stream:
                return stream.read(size)
        except FileNotFoundError:
            return None

    def clean_temp(self, older_than: float = 3600.0) -> int:
        """Delete temp files left by killed writers, and lock and lease files unused for ``older_than``
        seconds (a lock is held only while compiling); how many were removed."""
        removed = 0
        cutoff = time.time() - older_than
        for folder in (self.tmp, self.locks):
            if not folder.exists():
                continue
            for path in folder.iterdir():
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
        return removed


def _fsync_dir(path: pathlib.Path) -> None:
    """Make a new directory entry durable (best effort: not every platform can open directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
