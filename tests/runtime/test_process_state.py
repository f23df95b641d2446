"""Compiling and running a model leaves the user's jax as it was: every value of ``jax.config`` (platforms,
dispatch, x64, ...) is the same after a tpucompile compile and call as before, and jax's own backends are not
started by it. Run in a fresh process, whose jax nothing else has touched."""

from __future__ import annotations

from tests.fresh_process import run_json

_SCRIPT = r"""
import json

import jax
from jax._src import xla_bridge

before = {name: repr(value) for name, value in jax.config.values.items()}

import torch
import tpucompile  # noqa: F401

def step(x, w):
    return torch.tanh(x @ w).sum(dim=0) + 1.0

x, w = torch.randn(8, 16), torch.randn(16, 4)
compiled = torch.compile(step, backend="tpucompile")
got = compiled(x, w)
again = compiled(x, w)
after = {name: repr(value) for name, value in jax.config.values.items()}
changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
print(json.dumps({
    "changed": {name: [before.get(name), after.get(name)] for name in changed},
    "checked": len(before),
    "jax_backends_started": xla_bridge.backends_are_initialized(),
    "close": bool(torch.allclose(got, step(x, w), atol=1e-5) and torch.equal(got, again)),
    "compiled": tpucompile.stats()["total"]["compiles"],
}))
"""


def test_a_compile_and_call_changes_no_jax_setting(tmp_path):
    found = run_json(_SCRIPT, {"TPUCOMPILE_CACHE_DIR": str(tmp_path / "cache")})
    assert found["close"] and found["compiled"] >= 1
    assert found["checked"] > 100  # every value of jax.config, not a few chosen ones
    assert found["changed"] == {}, f"jax settings changed by tpucompile: {found['changed']}"
    assert not found["jax_backends_started"]
