"""Rolled layers under FSDP x TP, compiled for a TPU slice from meta weights (nothing runs here): the loop's
stacked parameters stay split like the parameters they stack, with the layer axis whole, so each iteration
gathers only its own layer and the forward's temporaries do not grow with the layers' weights."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import tpucompile
from tpucompile import driver
from tpucompile.contracts.loop_ops import is_loop, loop_parts
from tpucompile.sharding.annotate import OUTPUT_NAMES_KEY
from tpucompile.sharding.plan import decode_sharding, shard_annotation

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

from llama import Llama, LlamaConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")

TARGET = "tpu:v5e:2x4"


_PLANS: dict[int, list] = {}


def _plan(layers: int) -> list:
    """The compile events of one plan at ``layers`` layers, compiled once per module (two tests read the
    2-layer plan)."""
    if layers not in _PLANS:
        _PLANS[layers] = _compiled_plan(layers)
    return _PLANS[layers]


def _compiled_plan(layers: int) -> list:
    torch._dynamo.reset()
    mesh = tpucompile.Mesh({"data": 4, "model": 2})
    shard = tpucompile.fully_sharded(mesh) + tpucompile.tensor_parallel(
        mesh, column=["layers.*.attention.wq", "layers.*.feed_forward.w1"],
        row=["layers.*.attention.wo", "layers.*.feed_forward.w2"])
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=512, dim=2048, n_layers=layers, n_heads=16, n_kv_heads=8,
                                  hidden_dim=8192, max_seq_len=256)).to(torch.bfloat16)
    tokens = torch.zeros(8, 256, dtype=torch.long, device="meta")
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        compiled = torch.compile(model, backend="tpucompile", options={
            "targets": [TARGET], "mesh": mesh, "shard": shard, "cache_mode": "off", "roll_layers": True})
        compiled(tokens, targets=tokens).backward()
    finally:
        remove()
    return [e for e in events if e.target == TARGET]


def test_stacked_parameters_keep_their_split_and_temporaries_stay_flat_in_depth():
    shallow, deep = _plan(2), _plan(8)
    forward = next(e for e in deep if e.name.endswith("(forward)"))
    loops = [n for n in forward.graph.graph.nodes if is_loop(n)]
    assert len(loops) == 1
    stacks = loop_parts(loops[0])[2]
    assert stacks and all(s.target is shard_annotation for s in stacks)
    for stack in stacks:
        dims = decode_sharding(stack.args[1])[1]
        assert dims[0] == () and any(dims[1:]), dims  # the layer axis whole, the parameter's axes split
    for a, b in zip(shallow, deep, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
    forwards = [next(e for e in events if e.name.endswith("(forward)")) for events in (shallow, deep)]
    temporaries = [e.report["memory"]["temp"] for e in forwards]
    # 2 -> 8 layers: 23 -> 34 MB; with the stack split along the layer axis and gathered whole before the loop
    # it was 71 -> 632 MB (every layer's weights at once).
    assert temporaries[1] <= 2 * temporaries[0], temporaries
    # The backward returns each stacked gradient once, laid out as the layers' gradients, its outputs views of
    # it (``stacked_layer_outputs``): returned per layer, XLA copied each out of the loop's stacked buffer.
    backward = next(e for e in deep if e.name.endswith("(backward)"))
    parts = [slot for slot in backward.program.output_plan if slot.part is not None]
    assert len(parts) == 9 * 8, len(parts)
    stacked = {slot.index for slot in parts}
    assert all(backward.program.result_specs[k].shape[0] == 8 for k in stacked)


def test_the_backward_takes_each_saved_value_laid_out_as_the_forward_returns_it():
    """Saved values pass between the programs by name: a no-op view AOTAutograd returns for the backward (the
    loss's log-softmax, behind an alias) reaches the forward's output as its base once the passes drop the view,
    while the backward's placeholder keeps the view's name. The forward's layout is recorded under that name,
    so the backward takes it split as the forward returns it (taken by its own name it was replicated: a
    405B-shaped plan held the whole [tokens, vocabulary] log-softmax on every chip, 15.7 GiB)."""
    events = _plan(2)
    forward = next(e for e in events if e.name.endswith("(forward)"))
    backward = next(e for e in events if e.name.endswith("(backward)"))
    returned = set(forward.graph.meta[OUTPUT_NAMES_KEY])
    saved = [n for n in backward.graph.graph.nodes
             if n.op == "placeholder" and not n.name.startswith(("tangents_", "primals_"))]
    assert saved and all(n.name in returned for n in saved), [n.name for n in saved if n.name not in returned]
    layout = {n.args[0].name: decode_sharding(n.args[1])[1] for n in backward.graph.graph.nodes
              if n.target is shard_annotation and n.args[0].op == "placeholder"}
    (log_softmax,) = [n for n in saved if tuple(n.meta["val"].shape) == (8 * 256, 512)]  # [tokens, vocabulary]
    assert any(layout[log_softmax.name]), (log_softmax.name, layout[log_softmax.name])
