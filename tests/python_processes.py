"""Fresh Python processes for tests, started by forking a server that has torch, jax and tpucompile imported
(``tests/process_zygote.py``) instead of a new interpreter that imports them again: the imports are ~4 of the
~5 CPU-seconds a test's process costs before it does anything, and the suite starts about a hundred.

``run`` and ``popen`` take the arguments of ``subprocess.run`` / ``subprocess.Popen`` that the tests use, for
commands ``[sys.executable, ...]`` with ``-c``, ``-m`` or a script (and ``-u``). A request is forked only when
the child would be what a new interpreter gives: its environment differs from the server's only in variables
read after the imports (``TPUCOMPILE_*``; ``XLA_FLAGS`` and ``ALLOW_MULTIPLE_LIBTPU_LOAD``, read when jax starts
a backend or libtpu loads, which the server never does; ``PYTHONFAULTHANDLER``, which the child applies as the
interpreter would). Anything else (another ``PYTHONHASHSEED``, ``JAX_*`` or ``TORCH_*`` settings read at import,
an interpreter flag, piped stdin) starts a real process, as does everything with ``TESTS_FORKED_PROCESSES=0``.
``TESTS_FORKED_PROCESSES_LOG=FILE`` appends a line per request to FILE: forked, or real and why.
Tests about what a process imports or its hash seed use ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pathlib
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
_SAFE_PREFIXES = ("TPUCOMPILE_", "PYTEST_")
_SAFE_NAMES = frozenset({"XLA_FLAGS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "PYTHONFAULTHANDLER", "TESTS_FORKED_PROCESSES",
                         "TESTS_FORKED_PROCESSES_LOG"})
_STARTUP_SECONDS = 180.0


def enabled() -> bool:
    return os.environ.get("TESTS_FORKED_PROCESSES", "1") != "0"


def run(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
        capture_output: bool = False, text: bool = False, timeout: float | None = None,
        stdout: Any = None, stderr: Any = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a Python command, forked from the server where that is the same process."""
    if capture_output:
        stdout, stderr = subprocess.PIPE, subprocess.PIPE
    with popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
    return subprocess.CompletedProcess(list(args), process.returncode, out, err)


def popen(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False) -> Any:
    """A ``subprocess.Popen`` of a Python command, or an object with its methods (``pid``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``returncode``, ``stdout``/``stderr``) for a forked child."""
    full_env = dict(os.environ if env is None else env)
    request = _request(list(args), full_env, os.fspath(cwd) if cwd is not None else os.getcwd())
    server = _server() if request is not None else None
    unsafe = _unsafe(full_env, server.env) if server is not None else []
    _log(args, "command" if request is None else "no server" if server is None else unsafe)
    if server is None or unsafe:
        return subprocess.Popen(list(args), env=full_env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    return ForkedProcess(server.path, list(args), request, stdout, stderr, text)


def _log(args: Sequence[str], why_real: Any) -> None:
    path = os.environ.get("TESTS_FORKED_PROCESSES_LOG")
    if path:
        with open(path, "a") as log:
            where = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            log.write(json.dumps({"test": where, "forked": not why_real, "why_real": why_real or None,
                                  "command": [str(a)[:60] for a in args[1:3]]}) + "\n")


def _request(args: list[str], env: dict[str, str], cwd: str) -> dict[str, Any] | None:
    if not enabled() or not args or args[0] != sys.executable:
        return None
    rest, unbuffered = args[1:], False
    if rest[:1] == ["-u"]:
        rest, unbuffered = rest[1:], True
    if not rest:
        return None
    if rest[0] == "-c" and len(rest) >= 2:
        kind, target, arguments = "code", rest[1], rest[2:]
    elif rest[0] == "-m" and len(rest) >= 2:
        kind, target, arguments = "module", rest[1], rest[2:]
    elif not rest[0].startswith("-"):
        kind, target, arguments = "script", rest[0], rest[1:]
    else:
        return None
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    return {"kind": kind, "target": target, "args": arguments, "env": env, "cwd": cwd, "unbuffered": unbuffered}


def _unsafe(env: Mapping[str, str], server_env: Mapping[str, str]) -> list[str]:
    """The variables in which ``env`` and the server's differ that may be read before the imports end."""
    differing = set(env) ^ set(server_env) | {n for n in env if n in server_env and env[n] != server_env[n]}
    return sorted(n for n in differing if not (n.startswith(_SAFE_PREFIXES) or n in _SAFE_NAMES))


class _Server:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="tpucompile-forks-")
        self.path = os.path.join(self.folder, "server.sock")
        self.env = dict(os.environ)
        self.process = subprocess.Popen([sys.executable, "-m", "tests.process_zygote", self.path], cwd=REPO,
                                        env={**self.env, "PYTHONPATH": _python_path()},
                                        stdout=subprocess.PIPE, stderr=None, text=True)
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            selector = selectors.DefaultSelector()
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if selector.select(timeout=_STARTUP_SECONDS):
                self.ready = self.process.stdout.readline().strip() == "ready"
            selector.close()
        return self.ready and self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _python_path() -> str:
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(REPO), existing] if existing else [str(REPO)])


_lock = threading.Lock()
_servers: dict[int, _Server | None] = {}


def _server() -> _Server | None:
    """This process's server, started on first use (None where it could not start: real processes then)."""
    with _lock:
        pid = os.getpid()
        if pid not in _servers:
            server = _Server()
            atexit.register(server.stop)
            _servers[pid] = server if server.wait_ready() else None
        server = _servers[pid]
        if server is not None and server.process.poll() is not None:
            _servers[pid] = server = None
        return server


class ForkedProcess:
    """A child forked by the server, driven like a ``subprocess.Popen``: signals go to its pid; its exit
    status comes from the server, its parent."""

    def __init__(self, path: str, args: list[str], request: dict[str, Any], stdout: Any, stderr: Any,
                 text: bool) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        self.stdin = None
        ours: list[int] = []  # the child's ends of its streams, closed here once the server has them
        theirs = [os.open(os.devnull, os.O_RDONLY)]
        ours.append(theirs[0])
        for which, spec in (("stdout", stdout), ("stderr", stderr)):
            if spec == subprocess.STDOUT and which == "stderr":
                theirs.append(theirs[1])
                continue
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                stream: Any = os.fdopen(read, "rb")
                setattr(self, which, io.TextIOWrapper(stream, errors="replace") if text else stream)
                theirs.append(write)
                ours.append(write)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_WRONLY)
                theirs.append(fd)
                ours.append(fd)
            elif spec is None:
                theirs.append((1, 2)[which == "stderr"])
            elif isinstance(spec, int):
                theirs.append(spec)
            else:
                theirs.append(spec.fileno())
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(path)
        try:
            body = json.dumps(request).encode()
            socket.send_fds(self._connection, [len(body).to_bytes(8, "big") + body], theirs)
        finally:
            for fd in ours:
                os.close(fd)
        self._buffer = b""
        self._output: dict[str, Any] = {}
        self._readers: list[threading.Thread] | None = None  # started by the first ``communicate``
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._connection.settimeout(remaining)  # 0.0: one read of what has arrived, without waiting
            try:
                chunk = self._connection.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the process server ended before {self.args} did")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self._message(timeout)["status"]
            self.returncode = os.waitstatus_to_exitcode(status)
            self._connection.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        assert input is None, "forked processes get no stdin"
        if self._readers is None:
            self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True)
                             for name in ("stdout", "stderr") if getattr(self, name) is not None]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return self._output.get("stdout"), self._output.get("stderr")

    def _read(self, name: str) -> None:
        stream = getattr(self, name)
        self._output[name] = stream.read()
        stream.close()

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None and not stream.closed and self._readers is None:
                stream.close()
        self.wait()
