"""Fractional max pooling against eager PyTorch, forward (values and indices) and backward."""

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager


@pytest.mark.parametrize("shape, kernel, output", [
    ((2, 3, 9, 11), (2, 3), (4, 5)),
    ((1, 2, 7, 6), (3, 2), (3, 4)),
    ((3, 10, 10), (2, 2), (5, 1)),  # unbatched; one output row sits at the edge
    ((2, 2, 5, 7, 6), (2, 2, 3), (3, 4, 2)),
    ((2, 6, 5, 5), (2, 2, 2), (4, 3, 3)),  # unbatched 3-d
])
def test_fractional_max_pool(shape, kernel, output):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    dims = len(kernel)
    batch_channels = (shape[0], shape[1]) if len(shape) == dims + 2 else (1, shape[0])
    samples = torch.rand(*batch_channels, dims)
    pool_fn = F.fractional_max_pool2d if dims == 2 else F.fractional_max_pool3d

    def pool(x):
        return pool_fn(x, kernel, output_size=output, return_indices=True, _random_samples=samples)

    assert_compiles_like_eager(pool, x, grad=True)


def test_many_samples_pick_pytorchs_windows():
    """The windows' starts depend on float rounding of ``(i + u) * alpha``: many samples, small values ties-free."""
    torch.manual_seed(1)
    x = torch.randn(16, 8, 31, 29)
    samples = torch.rand(16, 8, 2)

    def pool(x):
        return F.fractional_max_pool2d(x, (3, 4), output_size=(12, 9), return_indices=True, _random_samples=samples)

    assert_compiles_like_eager(pool, x)
