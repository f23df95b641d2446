"""The tests' fresh processes forked from a server (``tests/python_processes.py``): each child is what a new
interpreter would be for the request (argv, environment, directory, streams, exit status, signals), and a
request a fork cannot serve identically starts a real interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import python_processes

_REPORT = ("import json, os, sys; print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'setting': "
           "os.environ.get('TPUCOMPILE_PROBE'), 'name': __name__, 'jax_started': __import__('jax')._src.xla_bridge"
           ".backends_are_initialized(), 'compiles': __import__('tpucompile').stats()['total']['compiles']}))")


@pytest.fixture(autouse=True)
def _forking_on(monkeypatch):
    monkeypatch.setenv("TESTS_FORKED_PROCESSES", "1")


def test_a_forked_child_is_the_requested_process(tmp_path):
    env = {**os.environ, "TPUCOMPILE_PROBE": "on"}
    with python_processes.popen([sys.executable, "-c", _REPORT, "a", "b"], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert isinstance(process, python_processes.ForkedProcess)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    report = json.loads(out)
    assert report == {"argv": ["-c", "a", "b"], "cwd": str(tmp_path), "setting": "on", "name": "__main__",
                      "jax_started": False, "compiles": 0}
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(7)\n")
    done = python_processes.run([sys.executable, str(script), "x"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (7, "__main__ ['x']\n")
    failed = python_processes.run([sys.executable, "-c", "raise ValueError('named')"], capture_output=True,
                                  text=True, timeout=120)
    assert failed.returncode == 1 and "ValueError: named" in failed.stderr
    faults = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with python_processes.popen([sys.executable, "-c", "import faulthandler; print(faulthandler.is_enabled())"],
                                env=faults, stdout=subprocess.PIPE, text=True) as process:
        assert isinstance(process, python_processes.ForkedProcess)
        assert process.communicate(timeout=120)[0] == "True\n"


def test_status_poll_timeout_and_signals_reach_the_child():
    process = python_processes.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                     stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL and process.poll() == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        python_processes.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_what_a_fork_cannot_reproduce_starts_a_real_interpreter():
    seeded = {**os.environ, "PYTHONHASHSEED": "7"}
    for args, env in (([sys.executable, "-c", "pass"], seeded), ([sys.executable, "-X", "dev", "-c", "pass"], None)):
        with python_processes.popen(args, env=env) as process:
            assert isinstance(process, subprocess.Popen), args
    done = python_processes.run([sys.executable, "-c", "print(hash('tpucompile'))"], env=seeded,
                                capture_output=True, text=True, timeout=120)
    again = subprocess.run([sys.executable, "-c", "print(hash('tpucompile'))"], env=seeded, capture_output=True,
                           text=True, timeout=120)
    assert done.stdout == again.stdout
