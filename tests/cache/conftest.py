"""Fixtures shared by the cache tests."""

import pytest

from tests.cache.cache_helpers import start_redis_server


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A persistent cache of the test's own (``$TPUCOMPILE_CACHE_DIR``), empty at the start, in place of the
    session's shared one, so what a test finds cached is only what it compiled itself."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def redis_server(tmp_path):
    """A ``redis-server`` of the test's own and its URL (skips the test where none is installed)."""
    started = start_redis_server(tmp_path)
    if started is None:
        pytest.skip("redis-server or redis-py is not installed (apt-get install -y redis-server; pip install redis)")
    server, url = started
    yield server, url
    server.kill()
    server.wait()
