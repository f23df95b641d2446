import torch

from tests.support import assert_compiles_like_eager


def test_add_mul():
    assert_compiles_like_eager(lambda a, b: a * b + 2, torch.randn(3, 4), torch.randn(4))


def test_linear_grad():
    w = torch.randn(5, 4)
    assert_compiles_like_eager(lambda x, w: torch.nn.functional.linear(x, w).tanh(), torch.randn(3, 4), w, grad=True)
