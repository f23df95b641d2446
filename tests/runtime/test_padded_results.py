"""Bucketed results that come back as inputs cross as the padded buffers they were cut from
(``runtime/padded_results``), and a value each call extends is taken padded past its bucket by its growth
(``padded_results.growing_arguments``): the same values as eager and as padding every input anew."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tpucompile
from tests.support import crossed_padded
from tpucompile.runtime import host_copies, padded_results
from tpucompile.runtime.padded_results import growing_arguments


def _growth(function, *examples) -> dict[int, tuple[int, ...]]:
    gm = make_fx(function, tracing_mode="symbolic")(*examples)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = gm.graph.output_node().args[0]
    symbols = frozenset(s for n in placeholders for size in n.meta["val"].shape if isinstance(size, torch.SymInt)
                        for s in size.node.expr.free_symbols)
    found, extending = growing_arguments(placeholders, list(outputs), symbols)
    assert set(extending) <= set(range(len(outputs))) and bool(extending) == bool(found)
    return found


def test_an_argument_that_a_result_extends_is_found_from_the_graph():
    cache, token = torch.randn(2, 5, 4), torch.randn(2, 1, 4)
    assert _growth(lambda c, t: (torch.cat([c, t], 1),), cache, token) == {0: (0, 1, 0)}
    assert _growth(lambda c, t: (torch.cat([c, t, t, t], 1),), cache, token) == {0: (0, 3, 0)}
    assert _growth(lambda c, t: (c * 2,), cache, token) == {}  # the same size: nothing to take it padded past
    assert _growth(lambda c, t: (torch.cat([c, c], 1),), cache, token) == {}  # 2s - s is no constant
    assert _growth(lambda c, t: (torch.cat([c, t.expand(2, 9, 4)], 1),), cache, token) == {}  # past the headroom
    assert _growth(lambda c, t: (torch.cat([c, t], 1).double(),), cache, token) == {}  # another dtype


def test_a_result_longer_along_a_fixed_dimension_is_no_growth(seeded):
    """Only runtime-sized dimensions grow: a result of the argument's runtime size and a larger fixed one is
    another value (here (s, 7) from (s, 3)), not the argument extended."""
    from tpucompile.runtime.buckets import live_graphs

    x = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    before = set(live_graphs())
    compiled = torch.compile(lambda x: torch.cat([x, x[:, :2], x[:, :2]], 1), backend="tpucompile",
                             options={"dynamic_mode": "bucket"})
    torch.testing.assert_close(compiled(x), torch.cat([x, x[:, :2], x[:, :2]], 1))
    (graph,) = [g for g in live_graphs() if g not in before]
    assert graph._headroom == {}


class _Decoder(torch.nn.Module):
    """One step of a decoder with a cache: the new position's key appended to the cache, the step's output
    attending over every position (a softmax and a product across the runtime-sized dimension); with
    ``counts``, also the cache's new length, a size the graph returns beside its tensors (as Hugging Face's
    sliding-window cache layers count the tokens seen)."""

    def __init__(self, counts: bool = False) -> None:
        super().__init__()
        self.key = torch.nn.Linear(8, 8)
        self.counts = counts

    def forward(self, cache: torch.Tensor, x: torch.Tensor) -> tuple[Any, ...]:
        cache = torch.cat([cache, self.key(x)], dim=1)
        weights = torch.softmax(torch.einsum("bd,bsd->bs", x[:, 0], cache), dim=-1)
        out = torch.einsum("bs,bsd->bd", weights, cache)
        return (cache, out, cache.shape[1]) if self.counts else (cache, out)


def _decode(model, steps: int, changed_at: int | None = None) -> list[torch.Tensor]:
    """``steps`` calls, each passing back the cache the previous one returned; at ``changed_at`` the cache is
    changed in place before it goes back."""
    torch.manual_seed(1)
    cache = torch.randn(2, 3, 8)
    torch._dynamo.mark_dynamic(cache, 1)
    outputs = []
    with torch.no_grad():
        for step in range(steps):
            if step == changed_at:
                cache.mul_(-1)
            cache, out, *length = model(cache, torch.randn(2, 1, 8))
            assert length in ([], [cache.shape[1]]), length
            outputs.append(out)
    outputs.append(cache)
    return outputs


@pytest.mark.parametrize(("changed_at", "counts"), [(None, False), (12, False), (None, True)],
                         ids=["unchanged", "changed-in-place", "length-returned"])
def test_a_cache_passed_back_crosses_unpadded_and_gives_eager_results(changed_at, counts, monkeypatch, seeded):
    """20 steps from a cache of 3 (buckets 16 and 32): after the first step in a bucket, which pads, every
    step takes the cache as the buffer the previous step returned, and every output equals eager's and the
    path that pads each call. A cache changed in place is padded again from its new values; a graph that
    also returns a size reuses the same way."""
    model = _Decoder(counts)
    expected = _decode(model, 20, changed_at)
    crossed = crossed_padded(monkeypatch)
    reused = _decode(torch.compile(model, backend="tpucompile", options={"dynamic_mode": "bucket"}), 20, changed_at)
    torch._dynamo.reset()
    padded = _decode(torch.compile(model, backend="tpucompile", options={
        "dynamic_mode": "bucket", "bucket_reuse_padded_results": False}), 20, changed_at)
    for got, pad, want in zip(reused, padded, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, pad, atol=0, rtol=0)
    # the first call pads the starting cache and the second learns that the cache comes back; from then on
    # each step takes the buffer the previous one returned, but for the step whose cache reaches 17 (bucket 32,
    # taken padded to 33, where the buffer returned for bucket 16 holds 17); a change in place pads once more
    reuses = crossed[:20]
    assert reuses.count(False) == (3 if changed_at is None else 4), reuses
    assert not reuses[14]
    if changed_at is not None:
        assert not reuses[changed_at]
    assert all(not any(later) for later in [crossed[20:]])  # the padding path found nothing to reuse


def test_the_cache_grows_in_its_own_buffer_and_a_cut_passed_twice_is_padded_the_second_time(seeded):
    """The program takes the cache over and writes the new position into it (``lowering/grown_in_place``):
    its buffer is gone after the call, so the same cache passed again (a search that tries two tokens from one
    state) is padded anew, and both calls give eager's results."""
    from tpucompile.runtime.buckets import live_graphs

    model = _Decoder()
    compiled = torch.compile(model, backend="tpucompile", options={"dynamic_mode": "bucket"})
    before = set(live_graphs())
    torch.manual_seed(2)
    cache = torch.randn(2, 3, 8)
    torch._dynamo.mark_dynamic(cache, 1)
    with torch.no_grad():
        for _ in range(3):  # the cache's output is seen coming back: its buffers are kept from then on
            cache, _ = compiled(cache, torch.randn(2, 1, 8))
        first, second = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
        got = [compiled(cache, first), compiled(cache, second)]
        want = [model(cache, first), model(cache, second)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (graph,) = [g for g in live_graphs() if g not in before]
    (position,) = graph._headroom  # the cache's place among the graph's arguments (the weights come first)
    assert graph._headroom[position] == (0, 1, 0)
    assert all(entry.donated == {position} for entry in graph._entries.values())


def test_a_value_passed_between_graphs_crosses_unpadded_and_stays_for_another_call(monkeypatch, seeded):
    """Two graphs (as a graph break leaves them): the first's result goes into the second at its own size,
    as the buffer it was cut from once the output is known to come back; the second does not take it over,
    so the same value passed again crosses the same way. (Values this large are noted; a small one is padded
    again, which costs less than noting it.)"""
    first = torch.compile(lambda x: torch.tanh(x) * 2, backend="tpucompile", options={"dynamic_mode": "bucket"})
    second = torch.compile(lambda h: h.softmax(0).sum(1), backend="tpucompile", options={"dynamic_mode": "bucket"})
    crossed = crossed_padded(monkeypatch)
    with torch.no_grad():
        for n in (9, 12, 14, 11):
            x = torch.randn(n, 4096)
            torch._dynamo.mark_dynamic(x, 0)
            hidden = first(x)
            torch._dynamo.mark_dynamic(hidden, 0)
            for _ in range(2):
                torch.testing.assert_close(second(hidden), (torch.tanh(x) * 2).softmax(0).sum(1))
    # per call of ``second``: found once the output came back (the first call marks it), and again for the
    # repeated call; ``first`` takes fresh tensors
    assert crossed.count(True) == 6, crossed


def test_padded_buffers_are_held_only_for_outputs_that_come_back_and_die_with_them(seeded):
    model = _Decoder()
    compiled = torch.compile(model, backend="tpucompile", options={"dynamic_mode": "bucket"})
    gc.collect()
    held = padded_results.held_count()  # by other tests' outputs still alive in this process
    with torch.no_grad():
        caches = [torch.randn(2, n, 8) for n in (5, 6, 7)]
        for cache in caches:
            torch._dynamo.mark_dynamic(cache, 1)
            kept = compiled(cache, torch.randn(2, 1, 8))  # outputs never passed back
        assert padded_results.held_count() == held
        stats_before = tpucompile.memory_stats()
        cache = kept[0]
        for _ in range(4):
            cache, _ = compiled(cache, torch.randn(2, 1, 8))
        assert padded_results.held_count() == held + 1  # the last cache's buffer; each earlier one died with its cut
        assert tpucompile.memory_stats()["held"]["outputs"] > stats_before["held"]["outputs"]
    del cache, kept, caches
    gc.collect()
    assert padded_results.held_count() == held


def test_a_cut_is_served_only_whole_and_unchanged(seeded):
    """A view of part of a cut, or a cut changed since, is no cut: it is padded anew."""
    slot = padded_results.ResultSlot()
    slot.fed_back = True
    buffer = host_copies.pad(torch.ones(2, 3), (2, 16))
    tensor = torch.ones(2, 3)
    padded_results.note_cut(tensor, slot, buffer)
    assert padded_results.find(tensor).buffer is buffer
    assert padded_results.find(tensor.detach()).buffer is buffer  # the same memory under another tensor
    assert padded_results.find(tensor[:, :2]) is None
    assert padded_results.find(tensor[1:]) is None
    tensor.add_(1)
    assert padded_results.find(tensor) is None
