"""Fixtures of the cache tests: a Redis server of their own."""

import pytest

from tests.cached_runs import start_redis_server


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
