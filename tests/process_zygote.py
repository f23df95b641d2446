"""A Python process with torch, jax and tpucompile imported (nothing run: no backend, no compile) that forks
a child per request, so that a test's fresh process starts in milliseconds instead of paying ~4 CPU-seconds of
imports (``tests/python_processes.py`` is the client; run as ``python -m tests.process_zygote SOCKET``).

A child is a fresh process for everything tpucompile and jax hold: no backend, no cache, no compiled
program exists before the fork. Its argv, environment (only where the client found the difference safe to
apply after the imports), working directory and standard streams are the request's. The server stays one
thread (forking with a second thread alive could copy a held lock): it polls its sockets and reaps children,
and reports each child's pid when it starts and its wait status when it ends on the request's connection.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import runpy
import selectors
import socket
import sys
import types

# What a test's process imports anyway; imported here once, in the server, before any fork.
import jax
import jax.numpy  # noqa: F401
import numpy
import torch
import torch._dynamo  # noqa: F401

import tpucompile.backend  # noqa: F401

MAX_REQUEST = 1 << 20
STREAMS = 3


def main(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # The imports' objects are left out of every collection in the children (the use gc.freeze exists for):
    # their full collections walk only what the child made, and never write to the pages they share.
    gc.collect()
    gc.freeze()
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for _key, _ in selector.select(timeout=0.02):
            connection, _ = listener.accept()
            children[_start(connection, listener, selector, children)] = connection
        _reap(children)
        if os.getppid() == 1:  # the test process that started this server is gone
            return


def _start(connection: socket.socket, listener: socket.socket, selector: selectors.BaseSelector,
           children: dict[int, socket.socket]) -> int:
    message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, STREAMS)
    size = int.from_bytes(message[:8], "big")
    while len(message) < 8 + size:
        chunk = connection.recv(MAX_REQUEST)
        if not chunk:
            raise ConnectionError("the request ended early")
        message += chunk
    request = json.loads(message[8:])
    pid = os.fork()
    if pid == 0:
        selector.close()
        listener.close()
        for other in children.values():
            other.close()
        connection.close()
        _run_child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"status": status}).encode() + b"\n")
            connection.close()


def _run_child(request: dict, fds: list[int]) -> None:
    """Become the requested process: streams, directory, environment, argv, then its code as ``__main__``;
    exits through the interpreter's normal shutdown (atexit handlers, thread joins) with its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy.random.seed()  # as a process of its own would be: not the server's global generator
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()  # as the interpreter does at start-up with this variable
    if request.get("unbuffered"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    kind, target, args = request["kind"], request["target"], request["args"]
    code = 0
    try:
        if kind == "code":
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main_module = types.ModuleType("__main__")
            main_module.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main_module
            exec(compile(target, "<string>", "exec"), main_module.__dict__)
        elif kind == "module":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as done:
        code = done.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv[1])
