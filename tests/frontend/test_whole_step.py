"""A training step captured as one program: ``torch.func.grad_and_value`` over ``torch.func.functional_call``,
compiled whole (forward and backward together, as JAX compiles a step), equal to the same step run eagerly,
also for models whose calls the frontend would route to ops ``torch.func`` cannot differentiate (attention's
kernel op, interpolation's product gradient): inside a transform those calls keep their plain form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpucompile import driver


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.qkv = torch.nn.Linear(128, 3 * 128)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(self.norm(self.conv(images)), scale_factor=2, mode="bilinear")  # (2, 8, 16, 16)
        tokens = x.flatten(2).transpose(1, 2).reshape(2, 128, 16)  # 128 tokens
        q, k, v = self.qkv(tokens.transpose(1, 2).reshape(2, 16, 128)).split(128, dim=-1)
        heads = [t.reshape(2, 1, 16, 128) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*heads, is_causal=True).mean(dim=(1, 2))


def _step(model):
    def step(params, buffers, images, target):
        def loss(values, state):
            out = torch.func.functional_call(model, (values, state), (images,))
            return F.mse_loss(out, target)

        return torch.func.grad_and_value(loss)(params, buffers)

    return step


@pytest.mark.parametrize("attention", ["kernel", "auto"])
def test_grad_and_value_step_compiles_as_one_program_and_equals_eager(attention):
    torch.manual_seed(0)
    model = _Net()
    images, target = torch.randn(2, 3, 8, 8), torch.randn(2, 128)
    params = {k: v.detach() for k, v in model.named_parameters()}
    eager_buffers = {k: v.clone() for k, v in model.named_buffers()}
    compiled_buffers = {k: v.clone() for k, v in model.named_buffers()}
    expected_grads, expected_loss = _step(model)(params, eager_buffers, images, target)
    before = driver.graphs_compiled()
    step = torch.compile(_step(model), backend="tpucompile", options={"attention": attention})
    grads, loss = step(params, compiled_buffers, images, target)
    assert driver.graphs_compiled() == before + 1, "the step was not one graph"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for name in params:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    for name in compiled_buffers:  # BatchNorm's running statistics, updated in the step
        torch.testing.assert_close(compiled_buffers[name], eager_buffers[name], msg=name)
