"""Views and shape manipulation against eager PyTorch, forward and (for floats) input gradients.

AOTAutograd regenerates outputs that merely alias an input outside the compiled graph, so each view here
is followed by an arithmetic op (``_fresh``): the view itself is then lowered, and its backward too.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager

DTYPES = [torch.float32, torch.bfloat16, torch.int32]
IDS = str


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rand(dtype, *shape):
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=dtype)
    if dtype is torch.bool:
        return torch.rand(*shape) > 0.5
    return torch.randint(-50, 50, shape, dtype=dtype)


def _fresh(*outputs):
    return tuple(o * 2 for o in outputs)


def _grad(dtype):
    return dtype.is_floating_point


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_reshape_permute_expand(dtype):
    def fn(x):
        return _fresh(
            x.view(-1, 8),
            x.reshape(6, -1),
            x.view(24, 8).t(),
            x.permute(2, 0, 1),
            x.permute(-1, -3, -2),
            x.transpose(-1, 0),
            x.mT,
            x.unsqueeze(-1),
            x.unsqueeze(0).squeeze(0),
            x[:, :1].squeeze(1),
            x[:1, :, :1].squeeze(),
            x.squeeze(-1),
            x.flatten(1),
            x.flatten(),
            x.unflatten(1, (2, -1)),
            x.movedim(0, -1),
            x.movedim((0, 1), (2, 0)),
            x.expand(2, -1, -1, -1),
            x[:, :1].expand(-1, 5, -1),
            x[0, 0, 0].expand(3, 2),
            x.view(4, 48)[:, None, :].expand(4, 3, 48).reshape(12, 48),
        )

    assert_compiles_like_eager(fn, rand(dtype, 4, 6, 8), grad=_grad(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_slicing_select_narrow(dtype):
    def fn(x):
        return _fresh(
            x[::2, -3:, 1:100:3],
            x[1:-1, ::4],
            x[-100:2, :, 7:],
            x[:, 5:2],
            x[..., -1],
            x[-1],
            x.select(1, -2),
            x.narrow(1, -3, 2),
            x.narrow(2, 0, 8),
            x[None, :, None, 3],
            x[:, 1::2][..., 3:-3:2],
        )

    assert_compiles_like_eager(fn, rand(dtype, 4, 6, 8), grad=_grad(dtype))


def test_cat_stack():
    def fn(a, b, c, empty, h):
        return _fresh(
            torch.cat([a, b, c], dim=-1),  # float32, int32 and bfloat16: promoted to float32
            torch.cat([a, empty, a], dim=1),  # the legacy 1-d empty tensor is skipped
            torch.cat([a[:, :0], a], dim=1),  # an empty tensor of the same rank
            torch.cat([h, a.half()]),
            torch.stack([a, a * 3], 1),
            torch.stack([a[:, :2], b.float()], -1),
            torch.stack([a[0, 0], a[1, 1]]),
        )

    assert_compiles_like_eager(
        fn,
        torch.randn(4, 6),
        rand(torch.int32, 4, 2),
        rand(torch.bfloat16, 4, 3),
        torch.empty(0),
        rand(torch.float16, 2, 6),
        grad=True,
    )


def test_cat_ints_and_bool():
    def fn(a, b, m):
        return torch.cat([a, b], 0) * 2, torch.cat([m, ~m], 1), torch.cat([m, a.bool()], -1).int()

    assert_compiles_like_eager(fn, rand(torch.int64, 3, 5), rand(torch.int8, 2, 5), rand(torch.bool, 3, 5))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_split_chunk_unbind(dtype):
    def fn(x):
        return _fresh(
            *x.split(3, 1),
            *x.split(3, -1),  # uneven: 3, 3, 2
            *x.split([1, 5], 1),
            *x.split([0, 4, 4], 2),
            *x.chunk(3, -1),
            *x.chunk(4, 1),  # 6 in chunks of 2: only three chunks
            *x.unbind(1),
            *x.tensor_split(3, 2),
        )

    assert_compiles_like_eager(fn, rand(dtype, 4, 6, 8), grad=_grad(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_flip_roll(dtype):
    def fn(x):
        return _fresh(
            x.flip(0, -1),
            x.flip(1),
            x.roll(2, 1),
            x.roll((1, -3), (0, 2)),
            x.roll(5),
            x.roll(-13, 2),
            x.roll(6, 1),
            x.fliplr(),
        )

    assert_compiles_like_eager(fn, rand(dtype, 4, 6, 8), grad=_grad(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_repeat_tile_pad(dtype):
    def fn(x):
        return _fresh(
            x.repeat(2, 1, 3),
            x.repeat(2, 1, 1, 3),
            x.tile((2,)),
            x.tile((2, 1, 1, 1)),
            F.pad(x, (1, 2)),
            F.pad(x, (1, 2, 0, 3), value=3),
            F.pad(x, (0, 0, 2, 2, 1, 0), value=-1),
            F.pad(x, (-1, 2, 1, -2)),  # negative padding crops
            x.expand(2, 3, 6, 8).repeat(1, 1, 2, 1),
        )

    assert_compiles_like_eager(fn, rand(dtype, 3, 6, 8), grad=_grad(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=IDS)
def test_diagonal_and_friends(dtype):
    def fn(x, m):
        return _fresh(
            x.diagonal(),
            x.diagonal(0, 1, 2),
            x.diagonal(-1, 0, 2),
            x.diagonal(2, 2, 1),  # dims given in reverse order
            x.diagonal(7, 1, 2),  # empty diagonal
            x.diagonal(-3, -1, -2),
            m.diag(),
            m.diag(1),
            torch.trace(m),
            torch.diag_embed(m[:, :3]),
        )

    assert_compiles_like_eager(fn, rand(dtype, 4, 6, 8), rand(dtype, 5, 5), grad=_grad(dtype))


def test_diagonal_write():
    """An in-place write to a diagonal view: functionalised to ``diagonal_scatter``."""

    def fn(x, v):
        y = x * 1
        y.diagonal(1, 0, 2).mul_(v)
        z = x * 2
        z.diagonal(-1).copy_(v[:3, :1].squeeze(1) + 1)
        return y, z

    assert_compiles_like_eager(fn, torch.randn(4, 6, 8), torch.randn(6, 4), grad=True)


def test_as_strided_and_unfold():
    def fn(x):
        return _fresh(
            x.as_strided((3, 4), (1, 3)),  # a transposed window
            x.as_strided((2, 2, 3), (12, 2, 1), 5),  # a strided window with an offset
            x.as_strided((5, 4), (2, 1)),  # overlapping windows: a gather
            x[:, 1:].as_strided((2, 3), (6, 1)),  # offset inherited from the input view
            x.t().as_strided((4, 2), (1, 6)),  # strides of a transposed input
            x.unfold(1, 3, 2),
            x.unfold(0, 2, 1),
            x.view(-1).unfold(0, 5, 5),
        )

    assert_compiles_like_eager(fn, torch.randn(4, 6), grad=True)


def test_view_dtype():
    def fn(x, h, i):
        return (
            x.view(torch.int32) + 1,
            h.view(torch.int16) + 1,
            x.view(torch.int16) + 1,  # narrower: the last dimension doubles
            i.view(torch.float32) * 1,  # wider: the last dimension halves
            (x * 2).view(torch.uint8).int(),
        )

    assert_compiles_like_eager(fn, torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16),
                               rand(torch.int16, 3, 8).abs())


def test_view_chain_in_training():
    """Several views between real ops, in a function with parameters, the way models use them."""

    def fn(x, w):
        heads = (x @ w).view(2, 5, 4, 3).transpose(1, 2)  # [batch, heads, seq, dim]
        scores = heads @ heads.transpose(-1, -2)
        merged = scores.transpose(1, 2).reshape(2, 5, -1)
        return merged[:, 1:, ::2].flatten(1).sum(-1)

    assert_compiles_like_eager(fn, torch.randn(2, 5, 12), torch.randn(12, 12), grad=True)
