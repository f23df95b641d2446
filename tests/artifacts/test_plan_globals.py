"""A plan is keyed on the process-wide torch state that changes what AOTAutograd makes of a graph: the default
dtype, deterministic algorithms, ``torch._functorch.config``. Two fresh processes share one cache directory and
compile the same training step under each setting in turn: in the cold one every flipped setting misses the
plans stored before it (it is traced, and its result is right), and in the warm one each setting finds the
plan its own run stored (nothing is traced)."""

from __future__ import annotations

from tests.cached_runs import workload_env
from tests.fresh_process import run_json
from tpucompile.cache import LocalStore, decode

_SCRIPT = r"""
import contextlib
import json

import torch

from tests.cached_runs import fresh_start


def step(x, w):
    return (torch.tanh(x @ w) * torch.arange(4.0)).sum()  # arange takes the default dtype


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


settings = {
    "unchanged": contextlib.nullcontext,
    "default_dtype": lambda: default_dtype(torch.float64),
    "deterministic": deterministic,
    "functorch_config": lambda: torch._functorch.config.patch(recompute_views=True),
}
found = {}
for name, setting in settings.items():
    with setting():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, generator=generator, dtype=torch.float32)  # the same inputs under every setting
        w = torch.randn(5, 4, generator=generator, dtype=torch.float32, requires_grad=True)
        with fresh_start() as events:
            loss = torch.compile(step, backend="tpucompile")(x, w)
            loss.backward()
        got, grad = loss.detach(), w.grad
        w.grad = None
        want = step(x, w)
        want.backward()
        ok = got.dtype == want.dtype and torch.allclose(got, want.detach()) and torch.allclose(grad, w.grad)
    found[name] = {"traced": [e.graph is not None for e in events], "ok": bool(ok), "dtype": str(got.dtype)}
print(json.dumps(found))
"""


def test_flipped_globals_miss_the_plan_and_unflipped_ones_reuse_it(tmp_path):
    cache = tmp_path / "cache"
    env = workload_env(cache)
    cold = run_json(_SCRIPT, env)
    plans = [k for k in LocalStore(cache).list_keys() if decode(LocalStore(cache).read(k), k).kind == "plan"]
    warm = run_json(_SCRIPT, env)
    assert all(run["ok"] for run in (*cold.values(), *warm.values())), (cold, warm)
    assert cold["default_dtype"]["dtype"] == "torch.float64"
    for name in cold:
        assert cold[name]["traced"] == [True, True], f"{name}: the cold run reused a plan of another setting"
        assert warm[name]["traced"] == [False, False], f"{name}: the warm run did not find its own plan"
    assert len(plans) == len(cold)  # one plan per setting
