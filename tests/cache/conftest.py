"""Fixtures shared by the cache tests."""

import pytest


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A persistent cache of the test's own (``$TPUCOMPILE_CACHE_DIR``), empty at the start, in place of the
    session's shared one, so what a test finds cached is only what it compiled itself."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
