"""Block boundaries: the values that pass between a model's repeated blocks are found from the module paths
Dynamo records, and, marked, they are what the forward saves below the full activation budget, so the backward
recomputes inside one block at a time; the gradients stay eager's."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from tpucompile import plan_replay
from tpucompile.frontend import activation_budget
from tpucompile.frontend.block_boundaries import block_of, mark_block_boundaries

from .test_activation_budget import _Block


class _Net(torch.nn.Module):
    """An embedding, three blocks in a ModuleList and a head: boundaries outside-to-block, block-to-block and
    block-to-outside."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(_Block(32, 128) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _node(path: str | None) -> torch.fx.Node:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    if path is not None:
        node.meta["nn_module_stack"] = {"outer": ("L['self'].model", object), "inner": (path, object)}
    return node


@pytest.mark.parametrize("path, block", [
    ("L['self'].model.layers.3.self_attn.q_proj", ".model.layers.3"),
    ("L['args'][0].transformer.h.11.mlp", ".transformer.h.11"),
    ("L['self'].blocks[2].attn", ".blocks[2]"),
    ("L['self'].experts.w1", None),  # no index: not a block
    ("L['args'][0].model.norm", None),  # the root's own index is not a block's
    (None, None),
])
def test_a_nodes_block_is_its_module_path_up_to_the_first_index(path, block):
    assert block_of(_node(path)) == block


def _joint_graph(monkeypatch, model: torch.nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """The joint forward-backward graph AOTAutograd hands the partition when ``model`` is trained on ``x``
    (traced anew: warm starts from this process's plans are turned off)."""
    seen = []
    partition = activation_budget.min_cut_rematerialization_partition
    monkeypatch.setattr(activation_budget, "min_cut_rematerialization_partition",
                        lambda joint, inputs, **kwargs: seen.append(joint) or partition(joint, inputs, **kwargs))
    monkeypatch.setattr(plan_replay, "compiled_from_plan", lambda *args, **kwargs: None)
    torch._dynamo.reset()
    # boundaries are marked where a budget below 1 is searched for: TPU compiles, which keep their layers
    # unrolled ("auto"), as here on the CPU
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off", "roll_layers": False})
    compiled(x).sum().backward()
    (joint,) = seen
    return joint


def _net_joint_graph(monkeypatch) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return _joint_graph(monkeypatch, _Net(), torch.randint(0, 64, (4, 16)))


def test_the_values_between_blocks_are_marked_to_be_saved(monkeypatch):
    joint = _net_joint_graph(monkeypatch)
    marked = mark_block_boundaries(joint, 1)
    must_save = [n for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]
    assert marked == len(must_save) > 0
    for node in must_save:  # each is read in another block than its own
        assert any(block_of(user) != block_of(node) for user in node.users), node
    crossing = {(block_of(n), block_of(u)) for n in must_save for u in n.users if block_of(u) != block_of(n)}
    assert {(None, ".blocks.0"), (".blocks.0", ".blocks.1"), (".blocks.1", ".blocks.2"), (".blocks.2", None)
            } <= crossing, crossing
    assert all(block_of(n) is None or n.meta.get("recompute") is None for n in joint.graph.nodes
               if n.op == "call_function" and all(block_of(u) == block_of(n) for u in n.users))


def test_a_graph_without_two_blocks_is_left_unmarked(monkeypatch):
    joint = _joint_graph(monkeypatch, _Block(32, 128), torch.randn(8, 32))
    assert mark_block_boundaries(joint, 1) == 0
    assert not any("recompute" in n.meta for n in joint.graph.nodes)


def test_below_the_full_budget_the_values_passed_from_block_to_block_are_saved(monkeypatch):
    """Partitioned at 0.05 with the boundaries marked, each block's output read by the next block is a value the
    backward receives, not one it recomputes from the embedding (unmarked, this partition recomputes them)."""
    joint = _net_joint_graph(monkeypatch)
    mark_block_boundaries(joint, 1)
    between_blocks = {n.name for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
                      and block_of(n) is not None and any(block_of(u) not in (None, block_of(n)) for u in n.users)}
    assert len(between_blocks) >= 2, between_blocks
    inputs = [n.meta["val"] for n in joint.graph.nodes if n.op == "placeholder"]
    with torch._functorch.config.patch(activation_memory_budget=0.05):
        _, backward = activation_budget.min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=1)
    received = {n.name for n in backward.graph.nodes if n.op == "placeholder"}
    assert between_blocks <= received, (between_blocks, received)
