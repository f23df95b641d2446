"""``executable_cache_size`` bounds the model it is given for: a model compiled with a limit of 1 drops only
its own executables, programs and plans from memory, never another model's."""

from __future__ import annotations

import torch

from tpucompile import artifacts
from tpucompile.artifacts import stores
from tpucompile.cache import MemoryStore


def test_each_group_drops_only_its_own_entries():
    store: MemoryStore[str] = MemoryStore(8)
    store.put("a1", "A1", group="a", limit=8)
    store.put("a2", "A2", group="a", limit=8)
    store.put("b1", "B1", group="b", limit=1)
    store.put("b2", "B2", group="b", limit=1)
    assert "b1" not in store and store.get("b2", group="b", limit=1) == "B2"
    assert store.get("a1", group="a", limit=8) == "A1" and "a2" in store
    # an entry both groups hold stays while either does
    store.get("a1", group="b", limit=1)
    assert "b2" not in store and "a1" in store
    store.put("b3", "B3", group="b", limit=1)
    assert "a1" in store  # group a still holds it
    assert store.stats.evictions == 2


def _model(scale: float):
    def model(x):
        return torch.sin(x) * scale + x
    return model


def test_a_small_limit_on_one_model_keeps_the_other_models_executables(cache_dir):
    artifacts.clear_memory()
    torch._dynamo.reset()
    roomy = torch.compile(_model(2.0), backend="tpucompile", dynamic=False)
    for size in (3, 4, 5):  # three executables, under the default limit
        torch.testing.assert_close(roomy(torch.ones(size)), _model(2.0)(torch.ones(size)))
    held = set(stores.executables._entries)
    assert len(held) == 3
    tight = torch.compile(_model(3.0), backend="tpucompile", dynamic=False,
                          options={"executable_cache_size": 1})
    for size in (6, 7, 8):
        torch.testing.assert_close(tight(torch.ones(size)), _model(3.0)(torch.ones(size)))
    now = set(stores.executables._entries)
    assert held <= now, "the limit of one model dropped another model's executables"
    assert len(now - held) == 1, "the model with a limit of 1 kept more than one executable"
