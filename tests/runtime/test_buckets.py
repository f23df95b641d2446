"""Bucketed executables (``dynamic_mode="bucket"``): one compile per bucket of sizes, results equal to eager
at every size inside a bucket, and per-size compiles (with a warning naming the op) for graphs that padding
would make inexact."""

import copy
import logging
import os
import pathlib
import sys
import warnings

import pytest
import torch

import tpucompile
from tests import python_processes
from tests.support import assert_close_tree
from tpucompile import driver
from tpucompile.config import Options
from tpucompile.errors import OptionsError, TpuCompileWarning
from tpucompile.metrics import compile_stats as stats
from tpucompile.runtime.buckets import bucket_size

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

BUCKETED = {"dynamic_mode": "bucket"}


def _bucket_compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "for a new bucket" in r.getMessage()]


def _per_size_compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "for new sizes" in r.getMessage()]


def test_bucket_sizes():
    assert [bucket_size(n, (), 16) for n in (1, 2, 15, 16, 17, 100, 2048)] == [16, 16, 16, 16, 32, 128, 2048]
    assert [bucket_size(n, (), 1) for n in (1, 3, 5)] == [1, 4, 8]
    assert [bucket_size(n, (8, 32), 16) for n in (5, 8, 9, 32, 33)] == [8, 8, 32, 32, 33]


def test_bucket_options():
    assert Options.from_sources({"buckets": "64, 8,32"}, environ={}).buckets == (8, 32, 64)
    assert Options.from_sources({}, environ={"TPUCOMPILE_BUCKETS": "128,512"}).buckets == (128, 512)
    with pytest.raises(OptionsError, match="buckets"):
        Options.from_sources({"buckets": [0, 8]}, environ={})
    with pytest.raises(OptionsError, match="dynamic_mode"):
        Options.from_sources({"dynamic_mode": "padded"}, environ={})
    per_input = Options.from_sources({"buckets": {"input_ids": [256, 64], ("mask", 1): "8,32"}}, environ={})
    assert per_input.buckets == (("input_ids", (64, 256)), ("mask:1", (8, 32)))
    for bad in ({"x:one": [8]}, {"x": [0]}, {3: [8]}):
        with pytest.raises(OptionsError, match="buckets"):
            Options.from_sources({"buckets": bad}, environ={})


def test_bucket_program_switches_per_platform():
    """The in-place fixed shapes only where XLA was seen to give the scatter a fixed shape; products over the
    whole bucket by default only for the CPU, whose compiler would pack their rows."""
    from tpucompile.config import fixed_shapes_in_place_for, products_on_padding_for

    assert [fixed_shapes_in_place_for(True, p) for p in ("cpu", "tpu", "cuda")] == [True, True, False]
    assert not fixed_shapes_in_place_for(False, "cpu")
    assert [products_on_padding_for("auto", p) for p in ("cpu", "tpu", "cuda")] == [True, False, False]
    assert products_on_padding_for(True, "tpu") and not products_on_padding_for(False, "cpu")
    assert Options.from_sources({}, environ={"TPUCOMPILE_BUCKET_PRODUCTS_ON_PADDING": "0"}
                                ).bucket_products_on_padding is False


def _mixed(x: torch.Tensor, w: torch.Tensor):
    """Ops the padding must stay out of: softmax, max and argmax over the dynamic dim, a product that
    contracts it, elementwise results of dynamic size, a reduction of a static dim."""
    h = torch.tanh(x @ w)
    return (torch.softmax(h, dim=0), h.amax(dim=0), h.argmax(dim=0), h.t() @ h, h * 2 + 1, h.mean(dim=1),
            h.sum())


def test_one_compile_per_bucket_and_eager_results(caplog, seeded):
    caplog.set_level(logging.INFO, logger="tpucompile")
    stats.reset()
    w = torch.randn(8, 8)
    compiled = torch.compile(_mixed, backend="tpucompile", options=BUCKETED)
    exact = torch.compile(copy.deepcopy(_mixed), backend="tpucompile", options={"dynamic_mode": "exact"})
    for n in (5, 9, 12, 16, 17, 30):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        got = compiled(x, w)
        assert_close_tree(got, _mixed(x, w))
        assert_close_tree(got, exact(x, w))
    # 5..16 share the bucket of 16; 17 and 30 share 32: one compile more, logged with the bucket
    assert len(_bucket_compiles(caplog)) == 1, _bucket_compiles(caplog)
    assert "=17 -> bucket 32" in _bucket_compiles(caplog)[0]
    (figures,) = [g for g in tpucompile.stats()["graphs"].values() if g["bucket_hits"]]  # not the exact copy's
    assert figures["compiles"] + sum(figures["hits"].values()) == 2  # a hit: the session cache had it
    assert len(figures["recompiles"]) == 1 and "bucket 32" in figures["recompiles"][0]
    assert figures["bucket_hits"] == 4  # six calls, two of them compiled


def test_buckets_are_the_default_and_exact_sizes_are_asked_for(caplog, seeded, monkeypatch):
    """Without options (``dynamic_mode="auto"``) a graph Dynamo hands over with symbolic sizes compiles per
    bucket (5, 9 and 12 share the bucket of 16: one compile, two bucket hits); ``dynamic_mode="exact"``
    compiles each size."""
    monkeypatch.delenv("TPUCOMPILE_DYNAMIC_MODE", raising=False)
    caplog.set_level(logging.INFO, logger="tpucompile")
    assert Options.from_sources({}, environ={}).dynamic_mode == "auto"

    def f(x):
        return torch.softmax(x, 0) * x.sum(0)

    for options in ({}, {"dynamic_mode": "exact"}):
        torch._dynamo.reset()
        stats.reset()
        caplog.clear()
        compiled = torch.compile(f, backend="tpucompile", options=options)
        for n in (5, 9, 12):
            x = torch.randn(n, 4)
            torch._dynamo.mark_dynamic(x, 0)
            assert_close_tree(compiled(x), f(x))
        bucket_hits = sum(g["bucket_hits"] for g in tpucompile.stats()["graphs"].values())
        if options:
            assert bucket_hits == 0 and len(_per_size_compiles(caplog)) == 2, _per_size_compiles(caplog)
        else:
            assert bucket_hits == 2 and not _per_size_compiles(caplog) and not _bucket_compiles(caplog)


def test_by_default_a_graph_that_cannot_bucket_compiles_per_size_and_says_so_in_the_log(caplog, seeded,
                                                                                     monkeypatch):
    """Buckets by default are not a request: a graph that padding would make inexact (the median of every
    element) compiles per size with a log line naming the op, where ``dynamic_mode="bucket"`` warns."""
    monkeypatch.delenv("TPUCOMPILE_DYNAMIC_MODE", raising=False)
    caplog.set_level(logging.INFO, logger="tpucompile")

    def op(x):
        return x.median()

    compiled = torch.compile(op, backend="tpucompile")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (5, 6, 7):
            x = torch.randn(3, n)
            torch._dynamo.mark_dynamic(x, 1)
            assert_close_tree(compiled(x), op(x))
    logged = [r.getMessage() for r in caplog.records if "once per size, not per bucket" in r.getMessage()]
    assert len(logged) == 1 and "aten.median" in logged[0], logged
    assert len(_per_size_compiles(caplog)) == 2


def test_listed_buckets_and_sizes_past_them(caplog, seeded):
    caplog.set_level(logging.INFO, logger="tpucompile")
    def f(x):
        return torch.softmax(x, 0) * x.amax(0)

    compiled = torch.compile(f, backend="tpucompile", options={**BUCKETED, "buckets": [8, 32]})
    for n in (3, 8, 9, 32, 40, 41):
        x = torch.randn(n, 4)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close_tree(compiled(x), f(x))
    buckets = [m.split("-> bucket ")[1].split()[0] for m in _bucket_compiles(caplog)]
    assert buckets == ["32", "40", "41"]  # 3 and 8 in 8 (the first compile), 9 and 32 in 32; past 32: per size


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    shifted = x.new_zeros(x.shape)
    shifted[:, 1:] = x[:, :-1].clone()
    shifted[:, 0] = 7.0
    return shifted


_ACTUAL_EXTENT_OPS = {
    # divide by the actual count, forward and backward (a runtime size as a number)
    "mean": lambda x: x.mean(dim=1),
    "var": lambda x: x.var(dim=1),
    "std-all": lambda x: x.std(dim=(0, 1), correction=0),
    "var_mean": lambda x: torch.var_mean(x, dim=1)[0] * torch.var_mean(x, dim=1)[1],
    # prefix scans (their backward flips along the padded dimension)
    "cumsum": lambda x: x.cumsum(dim=1) ** 2,
    "cumprod": lambda x: x.detach().cumprod(dim=1),  # its backward specialises the size in torch
    "logcumsumexp": lambda x: x.logcumsumexp(dim=1),
    "flip": lambda x: x.flip(1) * x,
    # padding sorted last; ties keep their order (the backward scatters along the padded dimension)
    "sort": lambda x: x.round().sort(dim=1, stable=True).values * x,
    "sort-descending": lambda x: x.round().sort(dim=1, descending=True, stable=True).values * x,
    "argsort": lambda x: x.argsort(dim=1, stable=True)[:, :3] * 1.0,
    "topk": lambda x: x.topk(3, dim=1).values,
    "topk-smallest": lambda x: x.topk(5, dim=1, largest=False).values,
    "argmax-ties": lambda x: x.round().argmax(dim=1) * 1.0,
    # placed and counted from the actual end (a cache growing by a token, a pad, the last position)
    "cat": lambda x: torch.cat([x, x.exp()], dim=1),
    "cat-token": lambda x: torch.cat([x, x[:, :1] * 3], dim=1),
    "pad": lambda x: torch.nn.functional.pad(x, (2, 3), value=-7.0),
    "crop": lambda x: torch.nn.functional.pad(x, (-1, -1)),
    "last": lambda x: x[:, -1] * 2,
    "last-two": lambda x: x[:, -2:] * 2,
    "positions-after": lambda x: x * torch.arange(x.shape[1], 2 * x.shape[1]),
    "length-as-value": lambda x: x * torch.full((1,), x.shape[1]),
    "window": lambda x: x[:, :2] * 2,
    "shift-right": lambda x: _shift_right(x) * x,  # T5's decoder inputs: a copy into a slice, then the start
    "gather": lambda x: x.gather(1, x.argsort(1)[:, :2]),
    "split": lambda x: torch.cat([p * (i + 1) for i, p in enumerate(x.split([2, x.shape[1] - 2], 1))], 1),
    "chunk-static-dim": lambda x: torch.stack(x.unsqueeze(2).expand(3, x.shape[1], 4).chunk(2, 2), 0) * 2,
    # index tensors into the padded dimension: negative ones count from the actual end (the backward adds
    # into a padded tensor at the same indices); Hugging Face's masks index by runtime-sized positions
    "negative-index-tensor": lambda x: x[:, [0, -1, -2]] * 2,
    "index-by-positions": lambda x: x[torch.arange(3)[:, None], torch.arange(x.shape[1]).flip(0)[None, :]] ** 2,
    "rows-of-a-padded-tensor": lambda x: x.t()[[-1, 0]] * 2,
    # index_put: the updates an index tensor's padding would place are dropped (its indices sent out of range)
    "index-put-at-padded-indices": lambda x: torch.zeros(4).index_put((x.argmax(0),), torch.tensor(1.0),
                                                                      accumulate=True),
    "index-put-of-padded-updates": lambda x: torch.zeros(3, 20).index_put((torch.arange(3)[:, None], x.argsort(1)),
                                                                          x * 2),
    "index-put-into-a-padded-tensor": lambda x: x.index_put((torch.tensor([0, 2]), torch.tensor([-1, 1])),
                                                            torch.tensor(5.0)),
    # order statistics: the padding sorted after every actual element (NaNs included), the row counted actual
    "median": lambda x: x.median(dim=1).values,
    "median-indices": lambda x: x.round().median(dim=1).indices * 1.0,
    "median-with-nans": lambda x: torch.where(x > 1.0, float("nan"), x).median(dim=1).values,
    "nanmedian": lambda x: torch.where(x > 0.5, float("nan"), x).nanmedian(dim=1).values,
    "kthvalue": lambda x: x.kthvalue(2, dim=1).values,
    # normalised over the padded dimension: the actual count divides (its backward's count is a runtime number)
    "layer-norm-over-padded-dim": lambda x: torch.nn.functional.layer_norm(x, (x.shape[1],)),
    "layer-norm-over-two-dims": lambda x: torch.nn.functional.layer_norm(x.t(), (3,)).t()
    + torch.nn.functional.layer_norm(x, tuple(x.shape)),
}


def test_buckets_per_input_dimension(caplog, seeded):
    """``buckets`` keyed by argument name (every dynamic dimension of it) or ``name:dim``: each dimension
    takes its own list, found through the sizes' sources in Dynamo's shape environment."""
    caplog.set_level(logging.INFO, logger="tpucompile")

    def f(tokens, features):
        return tokens.float().sum(1, keepdim=True) * features.softmax(0).sum(0)

    compiled = torch.compile(f, backend="tpucompile",
                             options={**BUCKETED, "buckets": {"tokens:1": [8, 100], "features": [40]}})
    for length, rows in ((5, 3), (9, 30), (50, 35), (7, 12)):
        tokens, features = torch.randint(0, 9, (2, length)), torch.randn(rows, 4)
        torch._dynamo.mark_dynamic(tokens, 1)
        torch._dynamo.mark_dynamic(features, 0)
        assert_close_tree(compiled(tokens, features), f(tokens, features))
    (recompile,) = _bucket_compiles(caplog)  # (8, 40) first; (100, 40) for 9 and 50 tokens
    assert "=9 -> bucket 100" in recompile and "=30 -> bucket 40" in recompile


@pytest.mark.parametrize("name", list(_ACTUAL_EXTENT_OPS))
def test_ops_that_read_the_actual_extent_stay_on_buckets(name, caplog, seeded):
    """Ops whose results depend on the extent of the padded dimension: their lowerings count and place by
    the actual extent (or XLA's dynamic padder does), so they stay on buckets, forward and backward, with
    eager's results at sizes inside a bucket and across two."""
    op = _ACTUAL_EXTENT_OPS[name]
    caplog.set_level(logging.INFO, logger="tpucompile")
    compiled = torch.compile(op, backend="tpucompile", options=BUCKETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (5, 7, 12, 18):
            x = torch.randn(3, n, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 1)
            got = compiled(x)
            expected = op(x)
            assert_close_tree(got, expected)
            if got.requires_grad:
                weights = torch.randn_like(expected)
                (grad,) = torch.autograd.grad((got * weights).sum(), x)
                (expected_grad,) = torch.autograd.grad((expected * weights).sum(), x)
                assert_close_tree(grad, expected_grad)
    assert not _per_size_compiles(caplog)
    assert {m.split("-> bucket ")[1].split()[0] for m in _bucket_compiles(caplog)} == {"32"}  # 18; 5..12 in 16


class _DropoutBlock(torch.nn.Module):
    """Dropout where Hugging Face's decoders put it: on the embeddings, in attention's probabilities and on
    the residual branch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        q, k, v = self.qkv(x).view(ids.shape[0], ids.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             dropout_p=0.25 if self.training else 0.0)
        return x + self.drop(y.transpose(1, 2).reshape(x.shape))


def test_dropout_stays_on_buckets_and_drops_what_it_should(caplog, seeded):
    """Random draws are one independent number per element, so the padding's draws are never read: a
    training step with dropout compiles per bucket, not per size. Compiled randomness is eager's in
    distribution, not in value: the kept fraction, the scaling of what is kept and a gradient that follows
    the same mask are checked; in eval mode results equal eager's."""
    caplog.set_level(logging.INFO, logger="tpucompile")
    block = _DropoutBlock()
    compiled = torch.compile(block, backend="tpucompile", options=BUCKETED)
    dropout = torch.compile(lambda e: block.drop(e), backend="tpucompile", options=BUCKETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (6, 13, 21):
            ids = torch.randint(0, 64, (8, n))
            torch._dynamo.mark_dynamic(ids, 1)
            out = compiled(ids)
            assert out.shape == (8, n, 32) and torch.isfinite(out).all()
            out.square().sum().backward()
            assert all(torch.isfinite(p.grad).all() for p in block.parameters())
            block.zero_grad()
            e = block.embed(ids).detach().requires_grad_()
            torch._dynamo.mark_dynamic(e, 1)
            d = dropout(e)
            fraction = (d != 0).float().mean().item()
            assert abs(fraction - 0.75) < 0.05, fraction  # 8 * n * 32 draws of keep-probability 0.75
            survivors = d != 0
            torch.testing.assert_close(d[survivors], e.detach()[survivors] / 0.75)
            (grad,) = torch.autograd.grad(d.sum(), e)
            torch.testing.assert_close(grad, survivors.float() / 0.75)
        block.eval()
        for n in (6, 13):
            ids = torch.randint(0, 64, (8, n))
            torch._dynamo.mark_dynamic(ids, 1)
            torch.testing.assert_close(compiled(ids), block(ids), rtol=1e-5, atol=1e-5)
    assert not _per_size_compiles(caplog), _per_size_compiles(caplog)
    assert _bucket_compiles(caplog), "21 needs the bucket of 32"


def test_a_window_from_the_end_longer_than_the_sequence_stays_on_buckets(caplog, seeded):
    """``x[:, :, -w:]`` on a sequence no longer than ``w`` (Hugging Face's sliding-window cache on every
    prompt shorter than its window) is the whole dimension, forward and backward, so it stays on buckets."""
    caplog.set_level(logging.INFO, logger="tpucompile")

    def keep_window(x):
        return x[:, :, -8:] * 2

    compiled = torch.compile(keep_window, backend="tpucompile", options=BUCKETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (3, 5, 7):
            x = torch.randn(2, 3, n, 4, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 2)
            got = compiled(x)
            assert_close_tree(got, keep_window(x))
            weights = torch.randn_like(got)
            (grad,) = torch.autograd.grad((got * weights).sum(), x)
            (expected,) = torch.autograd.grad((keep_window(x) * weights).sum(), x)
            assert_close_tree(grad, expected)
    assert not _per_size_compiles(caplog), _per_size_compiles(caplog)


@pytest.mark.parametrize("op, why", [
    (lambda x: x.median(), "aten.median(?=.*it flattens a padded tensor)"),
    (lambda x: torch.outer(x[0], x[1]).reshape(-1), "aten.view"),
], ids=["median-of-all", "two-padded-dims-merged"])
def test_ops_that_read_the_padded_extent_compile_per_size(op, why, caplog, seeded):
    caplog.set_level(logging.INFO, logger="tpucompile")
    compiled = torch.compile(op, backend="tpucompile", options=BUCKETED)
    with pytest.warns(TpuCompileWarning, match=f"once per size, not per bucket: {why}.*test_buckets.py"):
        for n in (5, 6, 7):
            x = torch.randn(3, n)
            torch._dynamo.mark_dynamic(x, 1)
            assert_close_tree(compiled(x), op(x))
    assert not _bucket_compiles(caplog)
    assert len(_per_size_compiles(caplog)) == 2  # 6 and 7 after 5: the exact path


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_nonzero_of_a_padded_tensor_compiles_per_size(caplog, seeded):
    """``nonzero`` counts what it is given, padding included (``x + 1 > 1`` is true in zero padding): its graph
    compiles per size, with the warning, and its results equal eager's."""
    caplog.set_level(logging.INFO, logger="tpucompile")

    def op(x):
        return (x + 1 > 1).nonzero() * 2

    compiled = torch.compile(op, backend="tpucompile", options=BUCKETED)
    with pytest.warns(TpuCompileWarning, match="once per size, not per bucket: aten.nonzero.*test_buckets.py"):
        for n in (5, 6, 7):
            x = torch.randn(3, n)
            torch._dynamo.mark_dynamic(x, 1)
            assert torch.equal(compiled(x), op(x))
    assert not _bucket_compiles(caplog)


@pytest.mark.parametrize("mode", ["exact", "bucket"])
@pytest.mark.parametrize("op", [
    lambda x: x.chunk(2, dim=2),
    lambda x: x[:, :1].expand(x.shape[0], 4, 6),
    lambda x: (x.transpose(0, 1), x.unbind(1)),
    lambda x: torch.nn.functional.channel_shuffle(x.permute(1, 2, 0).unsqueeze(0), 2),  # a view of a permute
], ids=["chunk", "expand", "transpose-unbind", "channel-shuffle"])
def test_outputs_that_view_inputs_keep_their_layout(op, mode, seeded):
    """AOTAutograd remakes such an output from the input with the layout of the tensor the graph returned
    when the view took symbolic sizes; that layout must be the view's (it was a fresh contiguous tensor: the
    expand raised, OpInfo's chunk sample gave wrong values)."""
    compiled = torch.compile(op, backend="tpucompile", options={"dynamic_mode": mode})
    for n in (5, 6, 7):
        x = torch.randn(n, 4, 6)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close_tree(compiled(x), op(x))


_W = torch.randn(8, 6)


@pytest.mark.parametrize("op", [
    lambda x: (x.reshape(-1, 8).sum(0), x.reshape(3, -1).amax(1)),  # merged: XLA packs the actual elements
    lambda x: torch.nn.functional.linear(x, _W.t()).softmax(1),  # (3 * s, 8) -> (3, s, 6) split back
    lambda x: (x.reshape(-1, 8) @ _W).reshape(3, -1, 2, 3).transpose(1, 2).softmax(-2),  # split into heads
    lambda x: (x.mean(dim=2), x.argmax(dim=1), x[:, 1:, :2].amax(1), x.select(1, 2)),
    lambda x: torch.nn.functional.embedding((x[..., 0] > 0).long(), _W),
    # rows merged with the padded dimension outermost, through a product, split back (XLA's padder aborted)
    lambda x: (x.unsqueeze(2).expand(-1, -1, 2, -1).reshape(3, 2 * x.shape[1], 8) @ x.transpose(1, 2)).reshape(
        3, x.shape[1], 2, x.shape[1]).softmax(-1),
    # regrouped with the padded dimension outermost on both sides, (s, 3, 8) -> (2 * s, 12): XLA's padder
    # refuses a reshape that splits and merges around it
    lambda x: (x.transpose(0, 1).contiguous().reshape(2 * x.shape[1], 12) * 3).softmax(0),
], ids=["merge-inner", "linear-3d", "split-heads", "static-reductions-and-slices", "embedding",
        "split-outer-after-product", "regroup-outer"])
def test_views_and_lookups_stay_on_buckets(op, caplog, seeded):
    caplog.set_level(logging.INFO, logger="tpucompile")
    compiled = torch.compile(op, backend="tpucompile", options=BUCKETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (5, 7, 12):
            x = torch.randn(3, n, 8)
            torch._dynamo.mark_dynamic(x, 1)
            assert_close_tree(compiled(x), op(x))
    assert not _per_size_compiles(caplog) and not _bucket_compiles(caplog)


def test_multihead_attention_trains_on_buckets_by_default(seeded, monkeypatch):
    """``nn.MultiheadAttention`` splits its heads with a reshape that regroups the padded sequence with the
    batch, ``(s, b * h, d) -> (s * b, h * d)`` (it failed in XLA's compile under buckets); with the default
    options, lengths inside and across buckets: outputs and every gradient as eager's, and bucket hits."""
    monkeypatch.delenv("TPUCOMPILE_DYNAMIC_MODE", raising=False)
    stats.reset()
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    eager = copy.deepcopy(attention)
    compiled = torch.compile(attention, backend="tpucompile")
    for n in (7, 12, 19, 30):
        x = torch.randn(2, n, 32)
        padding = torch.zeros(2, n, dtype=torch.bool)
        padding[1, -3:] = True
        got, expected = compiled(x, x, x, key_padding_mask=padding)[0], eager(x, x, x, key_padding_mask=padding)[0]
        assert_close_tree(got, expected)
        got.square().mean().backward()
        expected.square().mean().backward()
        for (name, p), q in zip(attention.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            p.grad = q.grad = None
    assert sum(g["bucket_hits"] for g in tpucompile.stats()["graphs"].values()) > 0


@pytest.mark.parametrize("switches", [{}, {"bucket_unmerged_products": False}, {"bucket_saved_unmerged": False}],
                         ids=["default", "merged-views", "saved-merged-views"])
def test_llama_training_on_buckets(switches, caplog, seeded):
    from llama import Llama, LlamaConfig

    caplog.set_level(logging.INFO, logger="tpucompile")
    model = Llama(LlamaConfig())
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tpucompile", options={**BUCKETED, **switches})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (5, 9, 16, 17, 23):
            tokens = torch.randint(0, 256, (2, n))
            torch._dynamo.mark_dynamic(tokens, 1)
            logits = compiled(tokens)
            expected = eager(tokens)
            assert_close_tree(logits, expected)
            logits.float().pow(2).mean().backward()
            expected.float().pow(2).mean().backward()
            for p, q in zip(model.parameters(), eager.parameters(), strict=True):
                assert_close_tree(p.grad, q.grad)
            model.zero_grad()
            eager.zero_grad()
    assert not [w for w in caught if issubclass(w.category, TpuCompileWarning)]
    assert not _per_size_compiles(caplog)
    # forward and backward each: the bucket of 16, then 32 for 17 and 23
    assert sorted(m.split(") for a new bucket")[0].split("(")[-1] for m in _bucket_compiles(caplog)) == [
        "backward", "forward"]


@pytest.mark.parametrize("unmerged", [True, False])
def test_products_of_merged_views_take_the_unmerged_tensor(unmerged, seeded):
    """A linear on (2, s, 8) is a view to (2 * s, 8), a product and a view back; in a bucketed program the
    product takes the (2, 16, 8) tensor itself (no merge for XLA to pack), unless switched off."""
    programs = []
    remove = driver.add_observer(lambda event: programs.append(event.program.text()))
    try:
        weight = torch.randn(6, 8)
        compiled = torch.compile(lambda x: torch.nn.functional.linear(x, weight), backend="tpucompile",
                                 options={**BUCKETED, "cache_mode": "off", "bucket_unmerged_products": unmerged})
        for n in (5, 7):
            x = torch.randn(2, n, 8)
            torch._dynamo.mark_dynamic(x, 1)
            assert_close_tree(compiled(x), torch.nn.functional.linear(x, weight))
    finally:
        remove()
    (text,) = programs
    products = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(products) == 1
    assert ("tensor<2x16x8xf32>" in products[0]) == unmerged
    assert ("tensor<32x8xf32>" in products[0]) == (not unmerged)


@pytest.mark.parametrize("unmerged", [True, False], ids=["base", "merged-view"])
def test_a_saved_merged_view_crosses_as_its_base(unmerged, seeded):
    """A linear on (2, s, 8) saves its input merged, (2 * s, 8), for the weight's gradient. A bucketed forward
    hands over the (2, s, 8) value itself, padded to its bucket, and the backward merges it again; with the
    switch off it hands over the merged view, whose actual rows XLA's padder packs first (a gather at the end
    of the forward). Gradients equal eager's either way, at two sizes of one bucket."""
    events = []
    remove = driver.add_observer(events.append)
    try:
        weight, scale = torch.randn(6, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        # the scaled value is saved for the weight's gradient only, as the product's merged operand
        f = lambda x: torch.nn.functional.linear(x.sin() * scale, weight).sin().sum()  # noqa: E731
        compiled = torch.compile(f, backend="tpucompile", options={
            **BUCKETED, "cache_mode": "off", "bucket_saved_unmerged": unmerged})
        for n in (5, 7):
            x = torch.randn(2, n, 8, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 1)
            got = torch.autograd.grad(compiled(x), (x, weight, scale))
            expected = torch.autograd.grad(f(x), (x, weight, scale))
            assert_close_tree(got, expected)
    finally:
        remove()
    forward = next(e for e in events if e.name.endswith("(forward)"))
    saved = [tuple(spec.shape) for spec in forward.program.result_specs]
    assert ((2, 16, 8) in saved) == unmerged, saved
    assert ((32, 8) in saved) == (not unmerged), saved


@pytest.mark.parametrize("on_padding", [True, False], ids=["whole-bucket", "packed"])
def test_products_over_free_runtime_dimensions_run_over_the_whole_bucket(on_padding, seeded):
    """A linear on (2, s, 8) with s runtime-sized: each result row depends on its own input row, so the
    product runs over the whole bucket (its operand's sizes dropped, its result marked again) and XLA's CPU
    compiler, which merges the free dimensions, has no rows to pack before it or unpack after; with the
    switch off it packs them (gathers). The results, a sum over s after the product (which must not count
    the padding rows) and the gradients match eager either way."""
    events = []
    remove = driver.add_observer(events.append)
    try:
        weight = torch.randn(6, 8, requires_grad=True)
        f = lambda x: torch.nn.functional.linear(x, weight).exp().sum(1)  # noqa: E731
        compiled = torch.compile(f, backend="tpucompile",
                                 options={**BUCKETED, "cache_mode": "off", "bucket_products_on_padding": on_padding})
        for n in (5, 7):
            x = torch.randn(2, n, 8, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 1)
            with torch.no_grad():
                assert_close_tree(compiled(x), f(x))
            got, expected = compiled(x), f(x)
            assert_close_tree(got, expected)
            # the backward's product for the input's gradient has the same free dimensions
            assert_close_tree(torch.autograd.grad(got.sum(), (x, weight)),
                              torch.autograd.grad(expected.sum(), (x, weight)))
    finally:
        remove()
    (inference,) = [e for e in events if e.name.endswith("(inference)")]
    optimized = "\n".join(m.to_string() for m in inference.executable.hlo_modules())
    assert (" gather(" in optimized) == (not on_padding)
    assert ('"stablehlo.scatter"(' in inference.program.text()) == on_padding


class _SavesInnerPadded(torch.nn.Module):
    """A block whose training forward saves values padded along an inner dimension (the sequence of a
    (batch, sequence, features) activation), where XLA would lay a runtime-sized result out packed."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 12)
        self.down = torch.nn.Linear(12, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return h * h.mean(dim=1, keepdim=True)


def _entry_results(executable) -> str:
    """The result types of a compiled program's entry computation (``f32[2,<=16,8]`` where XLA left a size
    to run time)."""
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    (entry,) = [line for line in text.splitlines() if line.startswith("ENTRY")]
    return entry.split("->")[-1]


def _train_saves_inner_padded(in_place: bool) -> list:
    """Two training steps of ``_SavesInnerPadded`` on buckets (sizes 5 and 11: one bucket), compiled for this
    machine and a TPU target, output and every gradient checked against eager; the compile events. Saved merged
    views cross as they are (``bucket_saved_unmerged`` off), so that XLA's packing of them is counted alike on
    both sides of the switch these figures compare."""
    block = _SavesInnerPadded()
    eager = copy.deepcopy(block)
    events = []
    remove = driver.add_observer(events.append)
    try:
        compiled = torch.compile(block, backend="tpucompile",
                                 options={**BUCKETED, "cache_mode": "off", "targets": ["tpu:v5e:1x1"],
                                          "bucket_fixed_shapes_in_place": in_place,
                                          "bucket_saved_unmerged": False})
        for n in (5, 11):
            x = torch.randn(2, n, 6, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 1)
            y = x.detach().clone().requires_grad_()
            got, expected = compiled(x), eager(y)
            assert_close_tree(got, expected)
            weights = torch.randn_like(expected)
            (got * weights).sum().backward()
            (expected * weights).sum().backward()
            assert_close_tree(x.grad, y.grad)
            for p, q in zip(block.parameters(), eager.parameters(), strict=True):
                assert_close_tree(p.grad, q.grad)
                p.grad = q.grad = None
    finally:
        remove()
    return events


def test_values_saved_for_the_backward_leave_the_forward_uncopied(seeded):
    """A bucketed training forward returns its runtime-sized values (its output and each value saved for the
    backward) padded as they lie: the lowered program writes each over a constant by a scatter, which XLA's
    dynamic padder takes as fixed in shape and its simplifier then removes, so neither the CPU's nor the
    TPU's program copies them; with the switch off each is copied by a gather. Either way both compilers
    return fixed shapes, and the output and every gradient match eager."""
    pytest.importorskip("libtpu")
    gathers = {}
    for in_place in (True, False):
        events = _train_saves_inner_padded(in_place)
        forwards = [e for e in events if e.name.endswith("(forward)")]
        (lowered,) = {e.program.text() for e in forwards}
        # the output and the 7 runtime-sized values saved for the backward (one more is of fixed shape), and
        # the two linears' operands, which drop their sizes before the product (bucket_products_on_padding)
        assert lowered.count('"stablehlo.scatter"(') == (10 if in_place else 0)
        assert lowered.count('"stablehlo.gather"(') == (0 if in_place else 10)
        assert {e.target for e in forwards} == {None, "tpu:v5e:1x1"}
        for event in events:  # this machine's programs and the TPU's
            assert "<=" not in _entry_results(event.executable), event.name
        for event in forwards:
            optimized = "\n".join(m.to_string() for m in event.executable.hlo_modules())
            assert " scatter(" not in optimized, event.target
            gathers[event.target, in_place] = optimized.count(" gather(")  # XLA's padder packs merged rows too
    for target in (None, "tpu:v5e:1x1"):
        assert gathers[target, False] - gathers[target, True] == 10, gathers


@pytest.mark.parametrize("padded", [True, False], ids=["kept-padded", "cut"])
def test_values_saved_for_a_bucketed_backward_stay_padded(padded, seeded):
    """The values a bucketed forward saves for a bucketed backward reach it as the forward's program returned
    them, padded to the bucket (16 rows here, 32 where two dimensions are merged), not cut to the actual size
    and padded again; the backward's program ignores the padding, so the gradients match eager. With the
    switch off each is cut to its actual size."""
    block = _SavesInnerPadded()
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, backend="tpucompile",
                             options={**BUCKETED, "cache_mode": "off", "bucket_saved_padded": padded})
    for n in (5, 11, 9):
        x = torch.randn(2, n, 6, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        y = x.detach().clone().requires_grad_()
        got, expected = compiled(x), eager(y)
        rows, merged = (16, 32) if padded else (n, 2 * n)
        # the weights, the input's merged view (remade from the input), then the activations: the first
        # linear's result merged, the second's operand as the value its merged view views
        # (``bucket_saved_unmerged``), the norm's values
        assert sorted(tuple(t.shape) for t in got.grad_fn.saved_tensors) == sorted([
            (12, 6), (6, 12), (6,), (2 * n, 6), (merged, 12), (2, rows, 12), (2, rows, 6), (2, rows, 6),
            (2, rows, 1), (2, rows, 1), (2, 1, 6)])
        assert_close_tree(got, expected)
        (got * got).sum().backward()
        (expected * expected).sum().backward()
        assert_close_tree(x.grad, y.grad)
        for p, q in zip(block.parameters(), eager.parameters(), strict=True):
            assert_close_tree(p.grad, q.grad)
            p.grad = q.grad = None


@pytest.mark.parametrize("sized_gradient", [True, False], ids=["size-in-gradient", "size-only-in-saved"])
def test_a_backward_takes_padded_values_only_when_it_reads_no_size_from_them(sized_gradient):
    """A backward whose only source of a size is a saved value (padded to the forward's bucket, it would read
    the bucket's size) leaves the forward cutting them; one that can read it from an output's gradient takes
    them padded. The sources prefer every other argument to the saved values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpucompile.contracts.saved_handoff import HandoffEnd, SavedHandoff
    from tpucompile.runtime.buckets import BucketedGraph

    def backward(activation, tangents):
        return activation * tangents

    # symbolic tracing gives equal sizes one symbol: the gradient's (3, 5) shares the activation's
    gradient = torch.randn(3, 5) if sized_gradient else torch.randn(())
    gm = make_fx(backward, tracing_mode="symbolic")(torch.randn(3, 5), gradient)
    shared = SavedHandoff(returns=1)
    graph = BucketedGraph("graph 0 (backward)", gm, lambda bounds, runtime, extents: None, [], (), 16, 4,
                          HandoffEnd("backward", shared))
    assert graph.symbols
    assert shared.backward_takes_padded == sized_gradient
    assert graph._may_arrive_padded == (frozenset({0}) if sized_gradient else frozenset())


_SWEPT = ["add", "mul", "div", "where", "exp", "tanh", "sigmoid", "nn.functional.gelu", "softmax", "log_softmax",
          "sum", "amax", "argmax", "mean", "var", "prod", "logsumexp", "matmul", "mm", "bmm", "linear",
          "nn.functional.layer_norm", "nn.functional.embedding", "cumsum", "sort", "flip", "cat", "transpose",
          "reshape", "view", "expand", "narrow", "select", "index_select", "triu", "masked_fill", "clamp",
          "nn.functional.cross_entropy", "nn.functional.relu", "pow", "rsqrt", "chunk", "expand_as", "flatten",
          "movedim", "diagonal", "std", "var_mean", "logcumsumexp", "topk", "argsort", "nn.functional.pad",
          "gather", "scatter_add", "split", "slice_scatter", "roll", "kthvalue", "linalg.vector_norm", "cummax",
          "index_put", "median", "nanmedian", "fft.fft", "fft.rfft2", "fft.irfft"]
"""OpInfos covering the lowering families a model's dynamic dimension meets (the whole database:
``python -m tests.opinfo.buckets``)."""


def _poisoned_pad(tensor: torch.Tensor, shape) -> torch.Tensor:
    """``tensor`` padded to ``shape`` with NaN (an integer type's largest value, True) instead of zeros."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    dtype = tensor.dtype
    fill = (float("nan") if dtype.is_floating_point or dtype.is_complex
            else True if dtype == torch.bool else torch.iinfo(dtype).max)
    out = torch.full(tuple(shape), fill, dtype=dtype, device=tensor.device)
    common = tuple(slice(0, min(have, want)) for have, want in zip(tensor.shape, shape, strict=True))
    out[common] = tensor[common]
    return out


@pytest.mark.slow
def test_opinfo_samples_with_a_dynamic_dimension_match_eager(monkeypatch):
    """Whatever the padding holds: every padded input's padding is NaN here, so a program that read it
    anywhere would give NaN or another value than eager. Bucketed programs never read padding (a training
    forward's saved values reach the backward with what its program left there), and the zeros the runtime
    pads with are only for tidiness."""
    from tests.opinfo import buckets as opinfo_buckets
    from tpucompile.runtime import host_copies

    poisoned = []

    def pad(tensor, shape):
        padded = _poisoned_pad(tensor, shape)
        poisoned.append(padded is not tensor)
        return padded

    monkeypatch.setattr(host_copies, "pad", pad)
    monkeypatch.setenv("TPUCOMPILE_BUCKET_STAGED_INPUTS", "0")  # every pad through host_copies.pad

    results = opinfo_buckets.run([o for o in opinfo_buckets.sweep.load_op_db() if o.name in _SWEPT], [0, -1],
                                 torch.float32, 1)
    wrong = [r for r in results if r.outcome in ("mismatch", "crash")]
    assert not wrong, wrong
    outcomes = {r.outcome for r in results}
    assert {"bucketed", "per-size"} <= outcomes, outcomes  # both paths were exercised
    assert sum(poisoned) > 100, sum(poisoned)


def test_compile_only_runs_compile_per_bucket(caplog):
    """A compile-only run (meta inputs, TPU target) compiles one TPU executable per bucket, and its outputs
    have the actual sizes."""
    pytest.importorskip("libtpu")
    caplog.set_level(logging.INFO, logger="tpucompile")
    compiled = torch.compile(lambda x: x.softmax(0) * x.mean(0), backend="tpucompile",
                             options={**BUCKETED, "targets": ["tpu:v5e:1x1"], "compile_only": True,
                                      "cache_mode": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for n in (5, 9, 20):
            x = torch.randn(n, 4, device="meta")
            torch._dynamo.mark_dynamic(x, 0)
            assert compiled(x).shape == (n, 4)
    assert [m.split("-> bucket ")[1].split()[0] for m in _bucket_compiles(caplog)] == ["32"]


_SERVER = '''
import sys
import torch

def step(x, w):
    return torch.softmax(x @ w, dim=0).sum(0) + x.mean(0)

compiled = torch.compile(step, backend="tpucompile")
w = torch.randn(8, 8)
for n in [int(a) for a in sys.argv[1:]]:
    x = torch.randn(n, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(compiled(x, w), step(x, w))
print("served")
'''


def test_warm_fills_every_bucket_so_a_server_never_compiles(tmp_path):
    """``tpucompile warm --buckets`` runs the script (one size: one bucket), then compiles every other listed
    bucket of its graph, for this machine and for a compile-only TPU target: a server started on that cache in
    strict mode (any compile is an error) then serves sizes from 3 to 64 and compiles nothing, and ``cache stats``
    counts its bucket hits."""
    import json

    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_")}
    warm = python_processes.run([sys.executable, "-m", "tpucompile", "warm", "--json", "--dir", str(cache), "--buckets",
                                 "16,32,64", "--target", "tpu:v5e:2x2", str(script), "5"],
                                env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr[-3000:]
    report = json.loads(warm.stdout[warm.stdout.index("{\n"):])
    assert report["buckets_filled"] == 2 and report["targets"]["tpu:v5e:2x2"]["compiled"] == 3
    serving = {**env, "TPUCOMPILE_CACHE_DIR": str(cache), "TPUCOMPILE_CACHE_MODE": "strict",
               "TPUCOMPILE_DYNAMIC_MODE": "bucket", "TPUCOMPILE_BUCKETS": "16,32,64"}
    serve = python_processes.run([sys.executable, str(script), "3", "17", "40", "64", "9"], capture_output=True,
                                 text=True, env=serving, timeout=300)
    assert serve.returncode == 0 and "served" in serve.stdout, serve.stderr[-3000:]
    stats = python_processes.run([sys.executable, "-m", "tpucompile", "cache", "stats", "--json", "--dir", str(cache)],
                                 env=env, capture_output=True, text=True, timeout=120)
    figures = json.loads(stats.stdout[stats.stdout.index("{"):])
    assert figures["graph_compiles"] == 3  # the warm run's: the server compiled nothing
    assert figures["bucket_hits"] == 2  # the server: 64 after 40, 9 after 3 (3, 17, 40: loaded from the cache)
