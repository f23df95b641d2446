"""What tpucompile leaves out is said, never skipped without a word: graph inputs a sharding plan cannot match,
layouts whose rank does not fit their value, and failures of the cache index (once per kind, not per call)."""

from __future__ import annotations

import sqlite3
import warnings

import torch
import torch.fx

from tpucompile import TpuCompileWarning
from tpucompile.cache import Entry, PersistentCache, tiered
from tpucompile.sharding.annotate import annotate_shardings
from tpucompile.sharding.plan import Mesh, ShardPlan, decode_sharding, shard_annotation

MESH = Mesh({"data": 2})
SPLIT = (("data",), ())


def _graph(*names: str) -> torch.fx.GraphModule:
    """A forward graph adding its 2-d inputs, whose placeholders carry ``names``."""
    graph = torch.fx.Graph()
    inputs = []
    for name in names:
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(4, 3)
        inputs.append(node)
    total = inputs[0]
    for other in inputs[1:]:
        total = graph.call_function(torch.ops.aten.add.Tensor, (total, other))
        total.meta["val"] = torch.empty(4, 3)
    graph.output((total,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _input_layouts(gm: torch.fx.GraphModule) -> dict[str, tuple]:
    return {n.args[0].name: decode_sharding(n.args[1])[1] for n in gm.graph.nodes
            if n.target is shard_annotation and n.args[0].op == "placeholder"}


def _caught(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, TpuCompileWarning)]


def test_an_input_the_plan_cannot_name_is_replicated_with_a_warning():
    gm = _graph("primals_1", "mystery_input")
    said = _caught(lambda: annotate_shardings(gm, MESH, ShardPlan(bound=(SPLIT, SPLIT))))
    assert _input_layouts(gm) == {"primals_1": SPLIT, "mystery_input": ((), ())}
    assert len(said) == 1 and "'mystery_input' is not named primals_N or argN_1" in said[0]
    assert "replicated" in said[0]
    # nothing to say when the plan splits no input: replicated is what it asks for
    assert _caught(lambda: annotate_shardings(_graph("primals_1", "other"), MESH, ShardPlan(bound=(None, None)))) == []


def test_a_layout_of_another_rank_is_skipped_with_a_warning():
    gm = _graph("primals_1", "primals_2")
    wrong_rank = (("data",), (), ())
    said = _caught(lambda: annotate_shardings(gm, MESH, ShardPlan(bound=(SPLIT, wrong_rank))))
    assert _input_layouts(gm) == {"primals_1": SPLIT, "primals_2": ((), ())}
    assert len(said) == 1
    assert "graph input primals_2 out as ('data', None, None) (3 dimensions), but it has 2" in said[0]
    assert "skipped" in said[0] and "replicated" in said[0]


def _entry(n: int) -> Entry:
    return Entry.create({"kind": "program", "n": n}, b"payload %d" % n, {}, 0.1)


def _cache_whose_index_fails(tmp_path, monkeypatch, error: Exception, *methods: str) -> PersistentCache:
    """A fresh cache whose index raises ``error`` from each of ``methods``, with no failure warned yet."""
    monkeypatch.setattr(tiered, "_index_failures_warned", set())
    cache = PersistentCache(tmp_path / "cache")

    def failing(*args, **kwargs):
        raise error

    for method in methods:
        monkeypatch.setattr(cache.index, method, failing)
    return cache


def test_cache_index_failures_warn_once_per_kind(tmp_path, monkeypatch):
    cache = _cache_whose_index_fails(tmp_path, monkeypatch, sqlite3.OperationalError("database is locked"),
                                     "record_put", "count")
    said = _caught(lambda: [cache.put(_entry(n)) for n in range(3)])
    assert len(said) == 1, said
    assert "'record_put'" in said[0] and "OperationalError: database is locked" in said[0]
    assert str(cache.index.path) in said[0]
    assert all(cache.get(_entry(n).key) is not None for n in range(3))  # the entries were still written
    said = _caught(lambda: [cache.record_miss() for _ in range(3)])  # another operation: one more warning
    assert len(said) == 1 and "'count'" in said[0]
    assert _caught(lambda: cache.put(_entry(9))) == []


def test_a_failed_lookup_in_the_index_is_a_warning_and_no_answer(tmp_path, monkeypatch):
    cache = _cache_whose_index_fails(tmp_path, monkeypatch, sqlite3.DatabaseError("file is not a database"),
                                     "nearest")
    found: list = []
    said = _caught(lambda: found.append(cache.nearest("program", {"kind": "program"})))
    assert found == [None]
    assert len(said) == 1 and "'nearest'" in said[0] and "DatabaseError: file is not a database" in said[0]
