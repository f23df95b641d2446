"""The activation budget's estimate under tensor parallelism: which mesh axes split each value the graphs
compute (``frontend/tensor_split.py``), and the bytes per chip the estimate counts with them. A column-parallel
product's result is split by the model axis as well as the batch, a row-parallel one's is whole across the
model axis, a weight's gradient is whole across the batch until it leaves laid out as its parameter, and an
FSDP-split weight is gathered for its product (the axis splits the product's batch dimension instead)."""

from __future__ import annotations

import torch
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from tpucompile.contracts.loop_ops import SCAN, body_of, is_loop
from tpucompile.frontend import activation_budget
from tpucompile.frontend.tensor_split import divisor, gathered_updates, value_splits

AXES = {"data": 4, "model": 8}
D, H, B = 64, 512, 32
DATA, MODEL, WHOLE = frozenset({"data"}), frozenset({"model"}), frozenset()
SPLITS = {
    "x": (DATA, WHOLE),                 # the batch, split by the data axis
    "w1": (MODEL | DATA, WHOLE),        # column-parallel [H, D]: FSDP and TP on its output features
    "w2": (DATA, MODEL),                # row-parallel [D, H]: TP on its input features
}


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1)), w2)


def _inputs(requires_grad: bool = False) -> list[torch.Tensor]:
    return [torch.randn(B, D), torch.randn(H, D, requires_grad=requires_grad),
            torch.randn(D, H, requires_grad=requires_grad)]


def _by_target(gm: torch.fx.GraphModule, target: object) -> list[torch.fx.Node]:
    return [node for node in gm.graph.nodes if node.target is target]


def test_column_then_row_parallel_products() -> None:
    gm = make_fx(_mlp, tracing_mode="fake")(*_inputs())
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    given = dict(zip(placeholders, SPLITS.values(), strict=True))
    splits = value_splits(gm, AXES, given.get)
    column, row = _by_target(gm, torch.ops.aten.mm.default)
    assert splits[column] == (DATA, MODEL)  # the weight gathered across data; its features stay split
    assert splits[row] == (DATA, WHOLE)      # the split features contracted: summed across the model axis
    gelu = _by_target(gm, torch.ops.aten.gelu.default)[0]
    assert splits[gelu] == (DATA, MODEL)
    assert divisor(splits[column], AXES) == 32 and divisor(splits[row], AXES) == 4


def test_views_heads_and_lookups() -> None:
    def attention_input(tokens: torch.Tensor, table: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hidden = table[tokens]                                  # [B, S, D] from an embedding lookup
        q = torch.nn.functional.linear(hidden, w)               # [B, S, H] column-parallel
        return q.view(B, 16, 8, H // 8).transpose(1, 2).sum(-1)  # heads split, then a reduction over head dim

    gm = make_fx(attention_input, tracing_mode="fake")(torch.randint(0, 100, (B, 16)), torch.randn(100, D),
                                                       torch.randn(H, D))
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    given = dict(zip(placeholders, [(DATA, WHOLE), (DATA, WHOLE), (MODEL | DATA, WHOLE)], strict=True))
    splits = value_splits(gm, AXES, given.get)
    lookup = _by_target(gm, torch.ops.aten.index.Tensor)[0]
    assert splits[lookup] == (DATA, WHOLE, WHOLE)  # the tokens' split, not the table's
    out = _returned(gm)[0]
    assert splits[out] == (DATA, MODEL, WHOLE)     # [B, heads, S]: the heads keep the model split


def _boxed(gm: torch.fx.GraphModule, _: object) -> object:
    return make_boxed_func(gm)


def _partitioned() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    graphs = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: list, **kwargs: object) -> tuple:
        graphs["forward"], graphs["backward"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return graphs["forward"], graphs["backward"]

    compiled = aot_function(_mlp, fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=partition)
    compiled(*_inputs(requires_grad=True)).sum().backward()
    return graphs["forward"], graphs["backward"]


def test_gradients_whole_across_the_batch_until_laid_out_as_their_parameters() -> None:
    forward, backward = _partitioned()
    splits = list(SPLITS.values())
    names = {node.name: node for node in forward.graph.nodes}

    def primal(node: torch.fx.Node) -> tuple | None:
        return splits[int(node.name.split("_")[1]) - 1] if node.name.startswith("primals_") else None

    inside = value_splits(forward, AXES, primal)

    def saved(node: torch.fx.Node) -> tuple | None:
        return primal(node) if node.name.startswith("primals_") else inside.get(names.get(node.name))

    weight_gradients = [mm for mm in _by_target(backward, torch.ops.aten.mm.default)
                        if tuple(mm.meta["val"].shape) in ((H, D), (D, H))]
    assert len(weight_gradients) == 2
    as_made = value_splits(backward, AXES, saved)
    assert all(DATA not in frozenset().union(*as_made[mm]) for mm in weight_gradients)  # the batch contracted
    assert {as_made[mm] for mm in weight_gradients} == {(MODEL, WHOLE), (WHOLE, MODEL)}
    as_returned = value_splits(backward, AXES, saved, splits)
    returned = _returned(backward)
    for position in (1, 2):
        assert as_returned[returned[position]] == splits[position]  # reduce-scattered where made


def _returned(gm: torch.fx.GraphModule) -> list:
    returned = gm.graph.output_node().args[0]
    return list(returned) if isinstance(returned, (list, tuple)) else [returned]


def test_estimate_counts_a_column_parallel_intermediate_split() -> None:
    forward, backward = _partitioned()
    splits = list(SPLITS.values())
    by_batch_alone = [tuple(axes & DATA for axes in split) for split in splits]
    tensor_parallel = activation_budget.step_peak(forward, backward, AXES, splits, splits)
    batch_only = activation_budget.step_peak(forward, backward, AXES, by_batch_alone, by_batch_alone)
    whole = activation_budget.step_peak(forward, backward)
    assert whole > batch_only > tensor_parallel
    # the [B, H] intermediates dominate: counted 8x smaller with the model axis; the bound is loose since inputs
    # and the row-parallel results do not shrink
    assert tensor_parallel < 0.5 * batch_only


def test_loop_body_working_set_counts() -> None:
    def stack(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        def body(carry: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = torch.tanh(carry @ w)
            return hidden @ w.t() + carry, hidden

        last, _ = SCAN(body, [x], [weights], [])
        return last

    gm = make_fx(stack, tracing_mode="fake")(torch.randn(B, D), torch.randn(3, D, H))
    loops = [node for node in gm.graph.nodes if is_loop(node)]
    assert loops
    body = body_of(loops[0])
    assert any(node.target is torch.ops.aten.tanh.default for node in body.graph.nodes)

    def size(node: torch.fx.Node) -> int:
        val = node.meta.get("val")
        return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

    without = activation_budget.program_peak(gm, size)
    def working_set(loop: torch.fx.Node) -> int:
        return activation_budget.program_peak(body_of(loop), size)

    with_body = activation_budget.program_peak(gm, size, working_set)
    assert with_body >= without + B * H * 4  # at least the body's [B, H] intermediate on top


def test_scatter_across_a_shared_axis_gathers_the_smaller_side() -> None:
    """An embedding's gradient: token rows split by the batch scattered into a table split by FSDP along the
    same axis; XLA gathers the updates or the table across it, whichever is smaller (the table held twice)."""
    def gradient_into(vocab: int) -> object:
        return lambda ids, rows: torch.zeros(vocab, D).index_put((ids,), rows, accumulate=True)

    for tokens, vocab in ((4096, 100), (64, 100_000)):  # the table the smaller side, then the rows
        ids, rows = torch.randint(0, 100, (tokens,)), torch.randn(tokens, D)
        gm = make_fx(gradient_into(vocab), tracing_mode="fake")(ids, rows)
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        given = dict(zip(placeholders, [(DATA,), (DATA, WHOLE)], strict=True))
        scatter = _by_target(gm, torch.ops.aten.index_put.default)[0]
        splits = value_splits(gm, AXES, given.get, [(DATA, WHOLE)])  # the gradient leaves laid out as its table
        assert splits[scatter] == (DATA, WHOLE)
        # the rows gathered when fewer, else the table whole twice (filled, then scattered into)
        assert gathered_updates(scatter, splits, AXES) == (tokens if tokens <= vocab else 2 * vocab) * D * 4


def test_symbolic_sizes_are_read_at_their_hints_without_guards() -> None:
    """A graph traced with changing sizes (buckets) is estimated at its traced sizes, adding no guard: matching
    the sizes of a view that merges two of them (batch x tokens) compares symbols."""
    def tokens_through_linear(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return _mlp(x.reshape(-1, D), w1, w2).reshape(x.shape)

    gm = make_fx(tokens_through_linear, tracing_mode="symbolic")(torch.randn(B, 24, D), *_inputs()[1:])
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    shape_env = placeholders[0].meta["val"].shape[0].node.shape_env
    guards = len(shape_env.guards)
    given = dict(zip(placeholders, [(DATA, WHOLE, WHOLE), SPLITS["w1"], SPLITS["w2"]], strict=True))
    splits = value_splits(gm, AXES, given.get)
    assert len(shape_env.guards) == guards
    column = _by_target(gm, torch.ops.aten.mm.default)[0]
    assert splits[column] == (DATA, MODEL)
    assert value_splits(gm, {}, lambda node: None) == {}  # no mesh: nothing to follow


def test_single_numbers_pass_through() -> None:
    """A 0-d value read by ops that name a dimension (a reduction over dim 0 of a number) is whole, and one
    multiplying a split value leaves its split."""
    gm = make_fx(lambda x: torch.amax(x, 0) + x.sum(0) + x.mean(0), tracing_mode="fake")(torch.tensor(1.0))
    splits = value_splits(gm, AXES, lambda node: ())
    assert all(split == (WHOLE,) * len(split) for split in splits.values())
    gm = make_fx(lambda scale, x: torch.mul(scale, x), tracing_mode="fake")(torch.tensor(2.0), torch.randn(B, D))
    scale, x = [node for node in gm.graph.nodes if node.op == "placeholder"]
    splits = value_splits(gm, AXES, {scale: (), x: (DATA, WHOLE)}.get)
    assert splits[_returned(gm)[0]] == (DATA, WHOLE)
