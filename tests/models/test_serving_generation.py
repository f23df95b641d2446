"""A generation server warmed ahead of time: Hugging Face Llama's greedy decoding with a static and with a
dynamic key/value cache (``generation_server.py``), its every bucket compiled by ``tpucompile warm --buckets``
for this machine and a TPU target, then served from that cache in strict mode (any compile is an error) for
prompt lengths the warm run never saw, token for token equal to eager."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests import python_processes

SERVER = pathlib.Path(__file__).with_name("generation_server.py")


def _report(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{\n"):])


def test_a_warmed_generation_server_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_")}
    # a new interpreter, not a fork of the tests' process server: forked there, libtpu's start-up (its probe for
    # a TPU host's metadata) stalled for minutes once transformers was imported
    warm = subprocess.run([sys.executable, "-m", "tpucompile", "warm", "--json", "--dir", str(cache),
                           "--buckets", "16,32", "--target", "tpu:v5e:2x2", str(SERVER), "5"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    report = _report(warm.stdout)
    # both caches' prompt graphs and the dynamic cache's decoding graph fill the buckets the prompt of 5 missed
    assert report["buckets_filled"] >= 3, report
    tpu = report["targets"]["tpu:v5e:2x2"]
    assert tpu["failed"] == {} and tpu["compiled"] == report["graphs"], tpu

    serving = {**env, "TPUCOMPILE_CACHE_DIR": str(cache), "TPUCOMPILE_CACHE_MODE": "strict",
               "TPUCOMPILE_DYNAMIC_MODE": "bucket", "TPUCOMPILE_BUCKETS": "16,32"}
    serve = python_processes.run([sys.executable, str(SERVER), "3", "17", "28"], capture_output=True, text=True,
                                 env=serving, timeout=600)
    assert serve.returncode == 0 and "served" in serve.stdout, serve.stderr[-3000:]
    stats = python_processes.run([sys.executable, "-m", "tpucompile", "cache", "stats", "--json", "--dir",
                                  str(cache)], env=env, capture_output=True, text=True, timeout=120)
    figures = json.loads(stats.stdout[stats.stdout.index("{"):])
    assert figures["graph_compiles"] == report["graphs"]  # the warm run's: the server compiled nothing
    assert figures["bucket_hits"] > 0
