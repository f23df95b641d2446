"""The benchmark's tools use jax directly; tpucompile sets jax up before its backend starts (as in any program
that compiles through tpucompile first), so it is made to do that before these tests start jax themselves."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _jax_set_up_by_tpucompile():
    from tpucompile.runtime import get_target

    get_target()
