"""Seeded random networks for differential tests: ``generate(seed)`` builds a plain ``nn.Module`` and its
inputs from an integer, the same on every machine and every run.

Four kinds, picked by ``seed % 4`` (so any four consecutive seeds cover them all); everything else (widths,
depths, kernel sizes, strides, dilations, groups, input layouts, which matmul spelling) is drawn from
``random.Random(seed)``, weights and inputs from ``torch.manual_seed(seed)``:

* ``dense``: DenseNet-like. A stem convolution (stride 1 or 2), one or two dense blocks, each layer
  BatchNorm-ReLU-(1x1 bottleneck)-3x3 convolution (dilated or grouped at random) over the concatenation of
  every earlier feature map of the block, transitions of BatchNorm-ReLU-1x1 convolution and average or max
  pooling, then global pooling and a Linear head.
* ``conv``: a random chain of convolutions (kernel 1-5, stride 1-2, dilation 1-3, grouped, depthwise),
  transposed convolutions (stride, padding, output padding, dilation, groups), BatchNorm-ReLU, max/average
  pooling, and concatenations with earlier feature maps of the same resolution. Two outputs: the last feature
  map and a pooled Linear head.
* ``attention``: transformer-style blocks on ``(batch, tokens, width)`` inputs: Linear on 3-D inputs, heads
  split by ``view``/``transpose`` or projected by ``einsum`` / broadcasting ``matmul`` with 3-D weights; scores
  as ``q @ k.transpose(-2, -1)``, ``q @ k.mT``, ``einsum``, ``bmm`` on flattened heads or ``(k @ q^T)^T``;
  values by ``matmul``, ``einsum``, ``bmm`` or transposed products; cross-attention on a second input with
  another length and width; causal masks; matrix-vector gates, outer products, ``F.linear`` with a transposed
  weight view. Two outputs: the token features and a pooled head.
* ``hybrid``: a convolution stem (BatchNorm in training mode) whose feature map becomes tokens
  (``flatten(2).transpose(1, 2)``) for an attention block.

Inputs come contiguous, channels-last (``.to(memory_format=torch.channels_last)``), permuted, or as slices of
a larger tensor (offsets and steps, so non-contiguous); 3-D inputs also transposed. A case holds the leaf
tensors (``Case.inputs``) and how the call arguments are made from them (``Case.arguments``), so gradients are
taken with respect to the leaves whatever view the module is called with. Modules are in training mode
(BatchNorm uses batch statistics and updates its running ones). Sizes are small: each case compiles
(forward and backward) in a few seconds.

    python tests/differential/random_networks.py 0 1 2 3     # print what those seeds build
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("dense", "conv", "attention", "hybrid")


@dataclasses.dataclass
class Case:
    """One network and its inputs."""

    name: str
    """Unique and stable, e.g. ``dense-4`` (kind and seed) or ``example-resnet``."""
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    """Leaf tensors; the floating ones get gradients."""
    make_args: Callable[[Sequence[torch.Tensor]], tuple] = tuple
    """Call arguments from (copies of) ``inputs``: views of them (slices, transposes), lists of them."""
    description: str = ""
    """What was drawn, for failure messages."""

    def arguments(self, dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], tuple]:
        """Fresh copies of the leaves (strides kept; floating ones require grad, converted to ``dtype`` if
        given) and the call arguments made from them."""
        leaves = []
        for tensor in self.inputs:
            copy = tensor.detach().clone()  # preserve_format: a channels-last leaf stays channels-last
            if copy.is_floating_point():
                if dtype is not None:
                    copy = copy.to(dtype)
                copy.requires_grad_(True)
            leaves.append(copy)
        return leaves, tuple(self.make_args(leaves))


def generate(seed: int, kind: str | None = None) -> Case:
    """The network of ``seed`` (its kind ``KINDS[seed % 4]`` unless ``kind`` is given)."""
    kind = kind or KINDS[seed % len(KINDS)]
    builder = {"dense": _dense, "conv": _conv, "attention": _attention, "hybrid": _hybrid}[kind]
    rng = random.Random(f"{kind}-{seed}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module, inputs, make_args, notes = builder(rng)
    module.train()
    return Case(f"{kind}-{seed}", module, tuple(inputs), make_args, f"{kind} seed {seed}: " + "; ".join(notes))


# ----------------------------------------------------------------------------------------------------------
# Inputs in various layouts


def _image_input(rng: random.Random, batch: int, channels: int, height: int, width: int, notes: list[str]):
    """A (batch, channels, height, width) leaf and the view the module is called with."""
    layout = rng.choice(["contiguous", "channels_last", "sliced", "permuted"])
    notes.append(f"input {layout} {batch}x{channels}x{height}x{width}")
    if layout == "contiguous":
        return torch.randn(batch, channels, height, width), lambda t: t
    if layout == "channels_last":
        return torch.randn(batch, channels, height, width).to(memory_format=torch.channels_last), lambda t: t
    if layout == "permuted":  # NHWC storage seen as NCHW
        return torch.randn(batch, height, width, channels), lambda t: t.permute(0, 3, 1, 2)
    # A slice of a larger tensor: channel offset, row offset, every other column.
    top, left = rng.randint(0, 2), rng.randint(0, 1)
    base = torch.randn(batch, channels + 1, height + top + 1, 2 * width + left)
    return base, lambda t: t[:, 1:, top : top + height, left : left + 2 * width : 2]


def _token_input(rng: random.Random, batch: int, length: int, width: int, notes: list[str]):
    """A (batch, length, width) leaf and the view the module is called with."""
    layout = rng.choice(["contiguous", "transposed", "sliced"])
    notes.append(f"tokens {layout} {batch}x{length}x{width}")
    if layout == "contiguous":
        return torch.randn(batch, length, width), lambda t: t
    if layout == "transposed":
        return torch.randn(batch, width, length), lambda t: t.transpose(1, 2)
    return torch.randn(batch, length + 2, width + 3), lambda t: t[:, 1:-1, 3:]


# ----------------------------------------------------------------------------------------------------------
# Convolutions


def _conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _groups(rng: random.Random, cin: int, cout: int) -> int:
    """A groups value dividing both widths: 1 most often (the host kernels take only ungrouped convolutions),
    else a common divisor (depthwise when cout % cin == 0 and the draw says so)."""
    choice = rng.random()
    if choice < 0.6:
        return 1
    if choice < 0.8 and cout % cin == 0:
        return cin
    common = [g for g in range(2, min(cin, cout) + 1) if cin % g == 0 and cout % g == 0]
    return rng.choice(common) if common else 1


def _bn_relu(channels: int) -> list[nn.Module]:
    return [nn.BatchNorm2d(channels), nn.ReLU()]


class DenseLayer(nn.Module):
    """BatchNorm-ReLU-(1x1 conv-BatchNorm-ReLU)-3x3 conv over the concatenation of the block's features."""

    def __init__(self, cin: int, growth: int, bottleneck: bool, dilation: int, groups: int) -> None:
        super().__init__()
        layers: list[nn.Module] = _bn_relu(cin)
        mid = cin
        if bottleneck:
            mid = 4 * growth
            layers += [nn.Conv2d(cin, mid, 1, bias=False), *_bn_relu(mid)]
        layers.append(nn.Conv2d(mid, growth, 3, padding=dilation, dilation=dilation, groups=groups, bias=False))
        self.body = nn.Sequential(*layers)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.body(torch.cat(features, 1))


class DenseBlock(nn.Module):
    def __init__(self, layers: list[DenseLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, stem: nn.Module, blocks: list[nn.Module], channels: int, classes: int) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.blocks(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _dense(rng: random.Random):
    notes: list[str] = []
    batch, size = rng.choice([2, 2, 4]), rng.choice([16, 20, 24, 32])
    height, width = size, size + rng.choice([0, 0, 4])
    x, view = _image_input(rng, batch, 3, height, width, notes)
    stem_width, stem_stride = rng.choice([8, 12, 16]), rng.choice([1, 1, 2] if size >= 24 else [1])
    stem = nn.Sequential(nn.Conv2d(3, stem_width, 3, stride=stem_stride, padding=1, bias=False))
    notes.append(f"stem conv 3->{stem_width} stride {stem_stride}")
    channels = stem_width
    blocks: list[nn.Module] = []
    n_blocks = rng.choice([1, 2, 2])
    for block in range(n_blocks):
        growth, n_layers, bottleneck = rng.choice([4, 6, 8]), rng.randint(2, 4 - block), rng.random() < 0.5
        layers = []
        for _ in range(n_layers):
            mid = 4 * growth if bottleneck else channels
            dilation = rng.choice([1, 1, 2])
            groups = rng.choice([g for g in (1, 1, 1, 2, 4) if mid % g == 0 and growth % g == 0])
            layers.append(DenseLayer(channels, growth, bottleneck, dilation, groups))
            channels += growth
            notes.append(f"dense layer -> {channels} (growth {growth}, bottleneck {bottleneck}, "
                         f"dilation {dilation}, groups {groups})")
        blocks.append(DenseBlock(layers))
        if block < n_blocks - 1:
            out = channels // 2
            pool = rng.choice([nn.AvgPool2d(2), nn.MaxPool2d(2), nn.AvgPool2d(3, stride=2, padding=1)])
            blocks.append(nn.Sequential(*_bn_relu(channels), nn.Conv2d(channels, out, 1, bias=False), pool))
            notes.append(f"transition -> {out}, {pool}")
            channels = out
    module = DenseNet(stem, blocks, channels, classes=rng.choice([5, 10]))
    _maybe_channels_last(rng, module, notes)
    return module, [x], lambda leaves: (view(leaves[0]),), notes


def _maybe_channels_last(rng: random.Random, module: nn.Module, notes: list[str]) -> None:
    """A quarter of the convolutional networks keep their 4-D weights channels-last."""
    if rng.random() < 0.25:
        module.to(memory_format=torch.channels_last)
        notes.append("weights channels-last")


class CatSkip(nn.Module):
    """Concatenates the running feature map with the output of an earlier step."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step


class ConvChain(nn.Module):
    def __init__(self, steps: list[nn.Module], channels: int, classes: int) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        for step in self.steps:
            x = torch.cat([x, outputs[step.step]], 1) if isinstance(step, CatSkip) else step(x)
            outputs.append(x)
        pooled = torch.cat([F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, 1)], 1).flatten(1)
        return x, self.head(pooled.view(x.shape[0], 2, -1).sum(1))


def _conv(rng: random.Random):
    notes: list[str] = []
    batch = rng.choice([2, 3, 4])
    height, width = rng.choice([16, 18, 24, 28]), rng.choice([16, 20, 24])
    channels = rng.choice([3, 4, 8])
    x, view = _image_input(rng, batch, channels, height, width, notes)
    steps: list[nn.Module] = []
    shapes: list[tuple[int, int, int]] = []  # (channels, height, width) after each step

    def add(step: nn.Module, note: str) -> None:
        steps.append(step)
        shapes.append((channels, height, width))
        notes.append(f"{note} -> {channels}x{height}x{width}")

    for _ in range(rng.randint(3, 6)):
        choice = rng.random() if steps else 0.3  # the chain starts with a convolution
        same = [i for i, s in enumerate(shapes[:-1]) if s[1:] == (height, width)]
        if choice < 0.15 and same and channels < 48:
            step = rng.choice(same)
            channels += shapes[step][0]
            add(CatSkip(step), f"cat with step {step}")
        elif choice < 0.6 or min(height, width) < 8:
            cout = rng.choice([4, 6, 8, 12, 16])
            groups = _groups(rng, channels, cout)
            batch_norm = rng.random() < 0.6  # a convolution BatchNorm follows has no bias
            bias = not batch_norm and rng.random() < 0.7
            if min(height, width) < 10 or rng.random() < 0.3:  # transposed convolution
                kernel, stride = rng.choice([2, 3, 4]), rng.choice([1, 2, 2])
                dilation = rng.choice([1, 1, 2])
                padding = rng.randint(0, (dilation * (kernel - 1)) // 2)
                output_padding = rng.randint(0, max(stride, dilation) - 1)
                layer: nn.Module = nn.ConvTranspose2d(
                    channels, cout, kernel, stride=stride, padding=padding, output_padding=output_padding,
                    groups=groups, dilation=dilation, bias=bias)
                height, width = ((size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
                                 for size in (height, width))
            else:
                kernel, stride = rng.choice([1, 3, 3, 5]), rng.choice([1, 1, 2])
                dilation = rng.choice([1, 1, 2, 3]) if kernel > 1 else 1
                padding = rng.randint(0, dilation * (kernel - 1) // 2 + 1)
                if _conv_out(min(height, width), kernel, stride, padding, dilation) < 4:
                    kernel, stride, dilation, padding = 3, 1, 1, 1
                layer = nn.Conv2d(channels, cout, kernel, stride=stride, padding=padding, dilation=dilation,
                                  groups=groups, bias=bias)
                height, width = (_conv_out(size, kernel, stride, padding, dilation) for size in (height, width))
            channels = cout
            if batch_norm:
                add(nn.Sequential(layer, *_bn_relu(channels)), f"{layer}, BatchNorm2d, ReLU")
            else:
                add(nn.Sequential(layer, nn.GELU()), f"{layer}, GELU")
        elif height >= 8 and width >= 8:
            pool = rng.choice([nn.MaxPool2d(2), nn.AvgPool2d(2), nn.MaxPool2d(3, stride=2, padding=1),
                               nn.AvgPool2d(3, stride=1, padding=1)])
            kernel, stride, padding = (v if isinstance(v, int) else v[0]
                                       for v in (pool.kernel_size, pool.stride, pool.padding))
            height, width = (_conv_out(size, kernel, stride, padding, 1) for size in (height, width))
            add(pool, str(pool))
    module = ConvChain(steps, channels, classes=rng.choice([3, 7]))
    _maybe_channels_last(rng, module, notes)
    return module, [x], lambda leaves: (view(leaves[0]),), notes


# ----------------------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """Multi-head attention with the spelling of each product drawn at random."""

    def __init__(self, rng: random.Random, dim: int, heads: int, kv_dim: int | None, causal: bool,
                 notes: list[str]) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.causal = causal
        kv_dim = kv_dim or dim
        self.project = rng.choice(["linear", "einsum", "broadcast"])
        self.scores = rng.choice(["matmul_t", "mT", "einsum", "bmm", "kq_t"])
        self.values = rng.choice(["matmul", "einsum", "bmm", "transposed"])
        self.merge = rng.choice(["linear", "einsum"])
        notes.append(f"attention dim {dim} heads {heads} kv_dim {kv_dim} causal {causal}: projections "
                     f"{self.project}, scores {self.scores}, values {self.values}, merge {self.merge}")
        if self.project == "linear":
            self.q = nn.Linear(dim, dim)
            self.k = nn.Linear(kv_dim, dim, bias=False)  # a key bias shifts every score of a row alike
            self.v = nn.Linear(kv_dim, dim)
        else:  # per-head weights (heads, in, head_dim)
            scale = 1 / math.sqrt(dim)
            self.wq = nn.Parameter(torch.randn(heads, dim, self.head_dim) * scale)
            self.wk = nn.Parameter(torch.randn(heads, kv_dim, self.head_dim) / math.sqrt(kv_dim))
            self.wv = nn.Parameter(torch.randn(heads, kv_dim, self.head_dim) / math.sqrt(kv_dim))
        if self.merge == "linear":
            self.out = nn.Linear(dim, dim)
        else:
            self.wo = nn.Parameter(torch.randn(heads, self.head_dim, dim) / math.sqrt(dim))

    def _heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """(batch, heads, length, head_dim)."""
        batch, length, _ = x.shape
        if self.project == "linear":
            y = getattr(self, name)(x)
            return y.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        weight = getattr(self, "w" + name)
        if self.project == "einsum":
            return torch.einsum("btd,hde->bhte", x, weight)
        return x.unsqueeze(1) @ weight  # (b, 1, t, d) @ (h, d, e): broadcast batch dimensions

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        memory = x if memory is None else memory
        q, k, v = self._heads(x, "q"), self._heads(memory, "k"), self._heads(memory, "v")
        batch, heads, length, head_dim = q.shape
        keys = k.shape[2]
        q = q * head_dim**-0.5
        if self.scores == "matmul_t":
            scores = q @ k.transpose(-2, -1)
        elif self.scores == "mT":
            scores = torch.matmul(q, k.mT)
        elif self.scores == "einsum":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif self.scores == "bmm":
            scores = torch.bmm(q.reshape(-1, length, head_dim), k.reshape(-1, keys, head_dim).transpose(1, 2))
            scores = scores.view(batch, heads, length, keys)
        else:
            scores = (k @ q.transpose(-2, -1)).transpose(-2, -1)
        if self.causal:
            mask = torch.ones(length, keys, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        weights = scores.softmax(-1)
        if self.values == "matmul":
            y = weights @ v
        elif self.values == "einsum":
            y = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        elif self.values == "bmm":
            y = torch.bmm(weights.reshape(-1, length, keys), v.reshape(-1, keys, head_dim))
            y = y.view(batch, heads, length, head_dim)
        else:
            y = (v.transpose(-2, -1) @ weights.transpose(-2, -1)).transpose(-2, -1)
        if self.merge == "linear":
            return self.out(y.transpose(1, 2).reshape(batch, length, heads * head_dim))
        return torch.einsum("bhte,hed->btd", y, self.wo)


class MLP(nn.Module):
    def __init__(self, rng: random.Random, dim: int, notes: list[str]) -> None:
        super().__init__()
        hidden = dim * rng.choice([2, 3, 4])
        self.form = rng.choice(["linear", "matmul", "transposed_weight", "einsum"])
        notes.append(f"mlp {dim}->{hidden} as {self.form}")
        self.up = nn.Linear(dim, hidden)
        if self.form == "linear":
            self.down = nn.Linear(hidden, dim)
        else:  # stored (hidden, dim): used directly, transposed into F.linear, or by einsum
            self.w = nn.Parameter(torch.randn(hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        if self.form == "linear":
            return self.down(h)
        if self.form == "matmul":
            return h @ self.w
        if self.form == "transposed_weight":
            return F.linear(h, self.w.t())
        return torch.einsum("bth,hd->btd", h, self.w)


class Gate(nn.Module):
    """Matrix-vector products and an outer product: a per-token gate and a token-mixing term."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.vector = nn.Parameter(torch.randn(dim) / math.sqrt(dim))
        self.mix = nn.Parameter(torch.randn(dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x @ self.vector)  # (b, t): matrix-vector
        summary = torch.einsum("btd,d->bt", x, self.mix).softmax(-1)
        mixed = torch.einsum("bt,bs->bts", summary, gate) @ x  # outer product, then batched matmul
        return x * gate.unsqueeze(-1) + 0.1 * mixed


class Block(nn.Module):
    def __init__(self, rng: random.Random, dim: int, heads: int, kv_dim: int | None, notes: list[str]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = Attention(rng, dim, heads, None, rng.random() < 0.5, notes)
        self.cross = None
        if kv_dim is not None:
            self.norm_cross = nn.LayerNorm(dim)
            self.cross = Attention(rng, dim, heads, kv_dim, False, notes)
        self.gate = Gate(dim) if rng.random() < 0.5 else None
        if self.gate is not None:
            notes.append("gate (matrix-vector, outer product)")
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(rng, dim, notes)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        if self.cross is not None:
            x = x + self.cross(self.norm_cross(x), memory)
        if self.gate is not None:
            x = self.gate(x)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, blocks: list[Block], dim: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = block(x, memory)
        x = self.norm(x)
        return x, self.head(x.mean(1))


def _attention(rng: random.Random):
    notes: list[str] = []
    batch, length = rng.choice([2, 3, 4]), rng.choice([5, 8, 12, 16])
    heads = rng.choice([1, 2, 4])
    dim = heads * rng.choice([4, 8, 12])
    x, view = _token_input(rng, batch, length, dim, notes)
    inputs, views = [x], [view]
    kv_dim = None
    if rng.random() < 0.4:  # cross-attention on a second input of another length and width
        kv_dim = rng.choice([6, 10, 16])
        memory, memory_view = _token_input(rng, batch, rng.choice([3, 7, 9]), kv_dim, notes)
        inputs.append(memory)
        views.append(memory_view)
    blocks = [Block(rng, dim, heads, kv_dim, notes) for _ in range(rng.choice([1, 1, 2]))]
    module = Transformer(blocks, dim, classes=rng.choice([3, 5]))
    return module, inputs, lambda leaves: tuple(v(t) for v, t in zip(views, leaves, strict=True)), notes


class Hybrid(nn.Module):
    def __init__(self, stem: nn.Module, block: Block, dim: int, classes: int) -> None:
        super().__init__()
        self.stem = stem
        self.block = block
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.stem(x)  # (b, dim, h, w)
        tokens = self.block(features.flatten(2).transpose(1, 2), None)
        return features, self.head(tokens.mean(1))


def _hybrid(rng: random.Random):
    notes: list[str] = []
    batch, size = 2, rng.choice([16, 20, 24])
    channels = rng.choice([3, 4])
    x, view = _image_input(rng, batch, channels, size, size, notes)
    heads = rng.choice([1, 2])
    dim = heads * rng.choice([8, 12])
    mid = rng.choice([8, 16])
    stride = rng.choice([2, 4])
    stem = nn.Sequential(nn.Conv2d(channels, mid, 3, padding=1, bias=False), *_bn_relu(mid),
                         nn.Conv2d(mid, dim, stride, stride=stride, groups=rng.choice([1, 2])), nn.GELU())
    notes.append(f"stem conv {channels}->{mid} 3x3, BatchNorm, patchify {stride}x{stride} -> {dim}")
    block = Block(rng, dim, heads, None, notes)
    module = Hybrid(stem, block, dim, classes=rng.choice([3, 4]))
    _maybe_channels_last(rng, module, notes)
    return module, [x], lambda leaves: (view(leaves[0]),), notes


if __name__ == "__main__":
    import sys

    for argument in sys.argv[1:] or ["0", "1", "2", "3"]:
        case = generate(int(argument))
        leaves, args = case.arguments()
        outputs = case.module(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        print(f"{case.name}: {case.description}")
        print(f"  inputs {[tuple(a.shape) for a in args]} strides {[a.stride() for a in args]}"
              f" -> outputs {[tuple(o.shape) for o in outputs]}, "
              f"{sum(p.numel() for p in case.module.parameters())} parameters")
