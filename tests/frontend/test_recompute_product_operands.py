"""The ``recompute_product_operands`` option: the partition may recompute in the backward a value a matrix
product reads (SwiGLU's ``silu(gate) * up``, an RMSNorm's output) instead of saving it. Checked on a stack of
gated MLP blocks and on Hugging Face's own Llama: what the forward saves, and every gradient against eager and
against the switch off."""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpucompile import driver

aten = torch.ops.aten
_RUNS = itertools.count()


class _GatedStack(nn.Module):
    """RMSNorm and SwiGLU blocks on a residual stream, as a decoder's MLPs."""

    def __init__(self, width: int = 16, hidden: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(width) for _ in range(depth))
        self.gates = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(depth))
        self.ups = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(depth))
        self.downs = nn.ModuleList(nn.Linear(hidden, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, gate, up, down in zip(self.norms, self.gates, self.ups, self.downs, strict=True):
            h = norm(x)
            x = x + down(F.silu(gate(h)) * up(h))
        return x


def _step(model: nn.Module, x: torch.Tensor, loss, **options) -> tuple[list[torch.Tensor], torch.fx.GraphModule]:
    """Gradients of one compiled training step (the input's first) and its backward ATen graph."""
    graphs: list[torch.fx.GraphModule] = []
    remove = driver.add_observer(
        lambda event: graphs.append(event.graph) if event.name.endswith("(backward)") else None)
    torch._dynamo.reset()
    try:
        # a plan key of its own per run (an option that changes nothing here), so that each run traces anew
        compiled = torch.compile(model, backend="tpucompile", options={
            "cache_mode": "off", "roll_layers": False, "embed_constant_limit": 4096 + next(_RUNS), **options})
        loss(compiled).backward()
    finally:
        remove()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (graph,) = graphs
    return grads, graph


def _saved(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The values the forward saved for this backward (not its parameters, not the incoming gradients)."""
    return {n.name: n.meta["val"] for n in gm.graph.nodes
            if n.op == "placeholder" and not n.name.startswith(("tangents", "primals"))}


def _products_read_saved(gm: torch.fx.GraphModule) -> set[str]:
    """The saved values a product of the backward reads directly (through views)."""
    saved = set(_saved(gm))
    read = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            for source in node.all_input_nodes:
                while source.op == "call_function" and source.target in (
                        aten.view.default, aten.permute.default, aten.t.default, aten._unsafe_view.default):
                    source = source.args[0]
                if source.name in saved:
                    read.add(source.name)
    return read


def test_recomputing_product_operands_saves_less_and_keeps_every_gradient():
    torch.manual_seed(0)
    model, x = _GatedStack(), torch.randn(4, 8, 16)

    def loss(net):
        return net(x).square().mean()

    eager_loss = loss(model)
    eager_loss.backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    kept, kept_graph = _step(model, x, loss, recompute_product_operands=False)
    recomputed, recomputed_graph = _step(model, x, loss, recompute_product_operands=True)

    def nbytes(gm):
        return sum(v.numel() * v.element_size() for v in _saved(gm).values())

    # off: each block's silu(gate) * up is saved for its down product's weight gradient; on: it is not
    # (the gate and up values are, for the gate's gradient), so fewer products read a saved value
    assert len(_products_read_saved(recomputed_graph)) < len(_products_read_saved(kept_graph))
    assert nbytes(recomputed_graph) < nbytes(kept_graph)
    for got_on, got_off, want in zip(recomputed, kept, eager, strict=True):
        torch.testing.assert_close(got_on, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_off, want, rtol=1e-5, atol=1e-5)


def test_hugging_face_llama_trains_like_eager_with_product_operands_recomputed():
    """HF's own ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary, grouped-query attention, its own mask), every
    gradient against eager, with the forward saving less than with the switch off."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 128, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # left padding on one row

    def loss(net):
        return net(input_ids=tokens, attention_mask=mask, labels=tokens).loss

    loss(model).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, kept_graph = _step(model, tokens, loss, recompute_product_operands=False)
    grads, graph = _step(model, tokens, loss, recompute_product_operands=True)
    assert sum(v.numel() for v in _saved(graph).values()) < sum(v.numel() for v in _saved(kept_graph).values())
    for got, want in zip(grads, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
