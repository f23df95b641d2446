"""Single flight across hosts: hosts that share only the remote tier compile each graph once in the fleet.

A simulated host is a process with cache directories of its own (``fleet_host.py``). Eight of them run as
one batch that goes through every scenario in turn (a process's imports and first compile cost more than
all of its scenarios, and the file must stay within its time budget), the test opening a gate before each
so that the hosts race on a cold cache:

* ``redis`` (a training step: two graphs) and ``fsspec`` (a ``file://`` directory as the bucket);
* ``stopped``: the redis-server is stopped (SIGSTOP: connections hang) while one host compiles the graph
  the others wait for;
* ``killed``: one host takes the graph's lease and is SIGKILLed while compiling it; the other seven go on.

The lease lasts 2 s here (renewed every third of it). The rules of the leases themselves are checked in this
process, without torch: generations on fsspec, garbage, renewal, release, bounded waits. The race of takers
for one expired fsspec lease runs 10 rounds; ``TPUCOMPILE_FLEET_ROUNDS=1000`` runs more.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import python_processes
from tests.cached_runs import start_redis_server
from tpucompile.cache.fleet import FleetClaims
from tpucompile.cache.remote import FsspecStore, GuardedRemote
from tpucompile.cache.remote_lease import FsspecLeases, Holder, parse_record

HOSTS = 8
LEASE = 2.0
REPO = pathlib.Path(__file__).resolve().parents[2]
KEY = "ab" * 32


class Fleet:
    """The host processes of one run and the gates the test opens for them."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.signals = root / "signals"
        self.signals.mkdir()
        self.hosts: list[subprocess.Popen] = []

    def start(self, name: str, steps: list[dict]) -> subprocess.Popen:
        plan = self.root / f"{name}.json"
        plan.write_text(json.dumps({"signals": str(self.signals), "steps": steps}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_CACHE")}
        return python_processes.popen([sys.executable, "-m", "tests.cache.fleet_host", str(plan)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(self, pattern: str, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.signals.glob(pattern))) < count:
            failed = [p for p in self.hosts if p.poll() not in (None, 0)]
            if failed:
                raise AssertionError(f"a host failed:\n{failed[0].communicate()[1][-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} {pattern} after {timeout:.0f}s")
            time.sleep(0.02)

    def open_gate(self, gate: str, count: int = HOSTS) -> None:
        """Let the hosts go once ``count`` of them wait at ``gate``."""
        self.wait_for(f"at-{gate}-*", count)
        (self.signals / gate).touch()


def _steps(process: subprocess.Popen, killed: bool = False) -> list[dict]:
    """The results of the steps ``process`` finished (all of them, unless the test killed it)."""
    out, err = process.communicate(timeout=180)
    expected = -signal.SIGKILL if killed else 0
    assert process.returncode == expected, f"host failed ({process.returncode}):\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _lease_record(url: str) -> dict:
    import redis

    client = redis.Redis.from_url(url)
    names = client.keys("tpucompile:v1:lease:*")
    return json.loads(client.get(names[0])) if names else {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> dict:
    """Runs the fleet once: every surviving host's step results by step name, and what the test saw."""
    root = tmp_path_factory.mktemp("fleet")
    servers = [start_redis_server(root) for _ in range(2)]
    if None in servers:
        pytest.skip("redis-server or redis-py is not installed (apt-get install -y redis-server; pip install redis)")
    (shared, shared_url), (stopped, stopped_url) = servers
    killed_url = shared_url.rsplit("/", 1)[0] + "/1"
    run = Fleet(root)

    def steps(host: str) -> list[dict]:
        def options(step: str, remote: str, **extra: object) -> dict:
            return {"cache_dir": str(root / host / step), "cache_remote": remote, "cache_remote_lease": LEASE,
                    "host_kernels": "off", **extra}

        killed = ({"name": "victim", "gate": "victim", "compile_delay": 600} if host == "host0"
                  else {"name": "killed", "gate": "killed"})
        return [
            {"name": "redis", "gate": "redis", "train": True, "options": options("redis", shared_url)},
            {"name": "fsspec", "gate": "fsspec", "options": options("fsspec", f"file://{root / 'bucket'}")},
            {"name": "stopped", "gate": "stopped", "scale": 2, "compile_delay": 2,
             "options": options("stopped", stopped_url, cache_remote_timeout=1)},
            {**killed, "scale": 3, "options": options("killed", killed_url)},
        ]

    observed: dict = {}
    run.hosts = [run.start(f"host{i}", steps(f"host{i}")) for i in range(HOSTS)]
    victim, survivors = run.hosts[0], run.hosts[1:]
    try:
        run.open_gate("redis")
        run.open_gate("fsspec")
        run.open_gate("stopped")
        run.wait_for("compiling-stopped-*", 1)
        time.sleep(1.0)  # the others reach the graph and wait for it (its compile takes 2 s)
        stopped.send_signal(signal.SIGSTOP)
        run.open_gate("victim", 1)
        run.wait_for("compiling-victim-*", 1)
        observed["lease_before_kill"] = _lease_record(killed_url)
        run.open_gate("killed", HOSTS - 1)
        time.sleep(LEASE)  # the others reach the graph and find it leased
        victim.kill()
        observed["killed_at"] = time.time()
        run.hosts = survivors
        results = [_steps(victim, killed=True)] + [_steps(host) for host in survivors]
    finally:
        for process in [*survivors, victim, shared, stopped]:
            process.kill()
            process.wait()
    by_step = collections.defaultdict(list)
    for steps in results:
        for step in steps:
            by_step[step["name"]].append(step)
    return {"steps": by_step, "victim_pid": victim.pid, **observed}


def _compiles_per_key(steps: list[dict]) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for step in steps:
        for event in step["events"]:
            counts[event["key"]] += event["tier"] is None
    return dict(counts)


@pytest.mark.parametrize("remote, graphs", [("redis", 2), ("fsspec", 1)])
def test_cold_fleet_compiles_each_graph_once(fleet, remote, graphs):
    steps = fleet["steps"][remote]
    assert len(steps) == HOSTS and all(step["ok"] for step in steps), "every host's results match eager"
    per_key = _compiles_per_key(steps)
    assert len(per_key) == graphs and set(per_key.values()) == {1}, per_key
    assert sum(step["stats"]["compiles"] for step in steps) == graphs
    loaded = [e["tier"] for step in steps for e in step["events"] if e["tier"] is not None]
    assert loaded == ["remote"] * graphs * (HOSTS - 1), "every other host loads the published entries"
    assert sum(step["fleet"].get("waited", 0) for step in steps) >= 1, "hosts raced and some waited"
    assert all(step["remote"]["errors"] == 0 for step in steps)


def test_remote_stopped_mid_run_costs_one_timeout_per_host(fleet):
    steps = fleet["steps"]["stopped"]
    assert len(steps) == HOSTS and all(step["ok"] for step in steps), "every host still finishes correctly"
    for step in steps:
        assert step["remote"]["errors"] == 1, step["remote"]  # one timeout, then the cool-down
        assert step["seconds"] < 30
    waiters = [step for step in steps if step["fleet"].get("waited", 0) >= 1]
    assert waiters, "the server stopped while one host compiled and others waited for it"
    assert all(step["fleet"].get("remote_unavailable", 0) >= 1 for step in waiters)
    assert all(e["tier"] is None for step in steps for e in step["events"]), (
        "nothing was published before the stop: every host compiled on its own")


def test_killed_holder_is_taken_over_after_its_lease(fleet):
    assert fleet["lease_before_kill"].get("pid") == fleet["victim_pid"], "the killed host held the lease"
    steps = fleet["steps"]["killed"]
    assert len(steps) == HOSTS - 1 and all(step["ok"] for step in steps), "the workload completes correctly"
    per_key = _compiles_per_key(steps)
    assert len(per_key) == 1 and set(per_key.values()) == {1}, per_key
    (started,) = [at for step in steps for at in step["compiles_started"]]
    assert fleet["killed_at"] < started < fleet["killed_at"] + LEASE + 10, (
        "nobody compiled the graph while its holder lived; one host did once the lease ran out")
    assert sum(step["fleet"].get("waited", 0) for step in steps) >= 1, "hosts found the graph leased"


# -- the lease rules, in this process --


def _race_to_take(store: FsspecStore, takers: list[Holder]) -> list[Holder]:
    """The takers that got ``KEY``'s lease, each through its own view of the store, all at once."""
    start = threading.Barrier(len(takers))
    won: list[Holder] = []

    def take(holder: Holder) -> None:
        start.wait()
        if FsspecLeases(store.fs, store.root).take(KEY, holder, 60).get("token") == holder.token:
            won.append(holder)

    threads = [threading.Thread(target=take, args=(holder,)) for holder in takers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won


def test_fsspec_takeover_of_an_expired_lease_has_one_winner(tmp_path):
    store = FsspecStore(f"file://{tmp_path}", timeout=1)
    for round_ in range(int(os.environ.get("TPUCOMPILE_FLEET_ROUNDS", "10"))):
        assert store.leases.take(KEY, Holder("old", "h", 1), 0.05)["token"] == "old"
        time.sleep(0.1)
        won = _race_to_take(store, [Holder(f"taker{round_}-{i}", "h", i) for i in range(4)])
        assert len(won) == 1, won
        assert store.leases.release(KEY, won[0])


def test_garbage_leases_never_block_for_long(tmp_path, redis_server):
    import redis

    _, url = redis_server
    redis.Redis.from_url(url).set(f"tpucompile:v1:lease:{KEY}", b"\xff not json")  # no expiry either
    remote = GuardedRemote(url, timeout=1)
    holder = Holder("mine", "h", 1)
    assert remote.take_lease(KEY, holder, 60)["token"] == "mine", "a value this code did not write is replaced"

    store = FsspecStore(f"file://{tmp_path}", timeout=1)
    folder = tmp_path / "v1" / "leases" / KEY
    folder.mkdir(parents=True)
    (folder / "7").write_bytes(b"garbage")
    (folder / "not-a-generation").write_bytes(b"{}")
    assert store.leases.take(KEY, holder, 0.3) == {}, "unreadable: maybe being written, held for one lease"
    time.sleep(0.35)
    assert store.leases.take(KEY, holder, 0.3)["token"] == "mine"
    assert (folder / "8").exists() and not (folder / "7").exists()
    assert parse_record(b'{"token": "x", "expires": Infinity}') is None, "a lease that would never end"


@pytest.mark.parametrize("remote", ["redis", "fsspec"])
def test_holder_renews_and_releases(tmp_path, request, remote):
    url = request.getfixturevalue("redis_server")[1] if remote == "redis" else f"file://{tmp_path}"
    # A lease of 1.5 s is renewed every 0.5 s: a renewal must stall a whole second to lapse, which a loaded
    # two-core machine running tests in parallel did reach with 0.3 s leases.
    lease = 1.5
    claims = FleetClaims(GuardedRemote(url, timeout=1), lease_seconds=lease)
    other = Holder("other", "h", 2)
    with claims.claim(KEY, published=lambda: False) as held:
        assert held
        time.sleep(2 * lease + 0.5)  # more than two leases long: renewed meanwhile
        assert claims.remote.take_lease(KEY, other, lease)["token"] != "other"
    assert claims.remote.take_lease(KEY, other, lease)["token"] == "other", "released at once"


@pytest.mark.parametrize("remote", ["redis", "fsspec"])
def test_a_lapsed_lease_nobody_took_is_held_again(tmp_path, request, remote):
    """A holder whose renewal comes late (its process stalled past the lease) and finds the lease gone takes it
    again when no other host did, so the others go on waiting for its compile."""
    url = request.getfixturevalue("redis_server")[1] if remote == "redis" else f"file://{tmp_path}"
    lease = 1.5
    claims = FleetClaims(GuardedRemote(url, timeout=1), lease_seconds=lease)
    renew = claims.remote.renew_lease
    late: list[float] = []

    def late_once(key, holder, seconds):
        if not late:
            late.append(time.monotonic())
            time.sleep(lease + 0.5)  # the first renewal comes after the lease has lapsed
        return renew(key, holder, seconds)

    claims.remote.renew_lease = late_once
    other = Holder("other", "h", 2)
    with claims.claim(KEY, published=lambda: False) as held:
        assert held
        while not late:
            time.sleep(0.05)
        time.sleep(lease + 0.5 + lease / 2)  # past the late renewal, inside the lease it took again
        assert claims.remote.take_lease(KEY, other, lease)["token"] != "other", "the lapsed lease was left open"
    assert claims.remote.take_lease(KEY, other, lease)["token"] == "other", "released at once"


def test_waiting_is_bounded(tmp_path, redis_server):
    server, url = redis_server
    holder = FleetClaims(GuardedRemote(url, timeout=1), lease_seconds=1.5)  # held throughout, even under load
    waiter = FleetClaims(GuardedRemote(url, timeout=1), lease_seconds=0.3, max_wait=0.5)
    with holder.claim(KEY, published=lambda: False):
        start = time.monotonic()
        with waiter.claim(KEY, published=lambda: False) as held:
            assert not held and 0.5 <= time.monotonic() - start < 2, "a holder that never finishes"
        assert waiter.counters["wait_expired"] == 1
        published = threading.Event()
        threading.Timer(0.2, published.set).start()
        with FleetClaims(GuardedRemote(url, timeout=1)).claim(KEY, published=published.is_set) as held:
            assert not held, "the entry appeared: the waiter loads it"

        late = FleetClaims(GuardedRemote(url, timeout=1), lease_seconds=0.3)
        threading.Timer(0.3, server.send_signal, [signal.SIGSTOP]).start()
        start = time.monotonic()
        try:
            with late.claim(KEY, published=lambda: False) as held:
                assert not held and time.monotonic() - start < 4, "a silent remote: one timeout, then alone"
        finally:
            server.send_signal(signal.SIGCONT)
        assert late.remote.errors == 1 and late.counters["remote_unavailable"] == 1
