"""The hand-written JAX references of the vision and recommendation examples (``bench/jax_reference``: ResNet,
UNet, DLRM) against the torch examples run eagerly: inference in eval mode; in train mode, the training loss,
the BatchNorm buffers that forward writes and every parameter's gradient in float32; and the loss of the
bfloat16 model.

Each model is built at its example's default config with the seed, batch and loss of its workload in
``bench/models.py`` (ResNet-18 is checked for inference only, on smaller images). JAX runs on the CPU here,
where float32 convolutions and matmuls are computed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bench.models  # noqa: F401  (puts examples/ on sys.path)
from bench.jax_reference import dlrm as jax_dlrm
from bench.jax_reference import resnet as jax_resnet
from bench.jax_reference import unet as jax_unet

F32 = dict(rtol=1e-4, atol=1e-5)
F32_GRAD = dict(rtol=1e-4, atol=1e-6)
"""The gradients are mostly 1e-3 to 1e-1 in magnitude (their differences stay below 1e-6)."""
BF16_LOSS_RTOL = 2e-2


@dataclasses.dataclass
class Case:
    model: nn.Module
    config: object
    inputs: tuple
    """The inference call's arguments (float tensors are cast to the model's dtype before use)."""
    labels: torch.Tensor
    torch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """The workload's loss of the model's output against the labels."""
    reference: ModuleType
    eval_for_inference: bool


def _resnet() -> Case:
    from resnet import ResNet, ResNetConfig

    config = ResNetConfig()
    model = ResNet(config)
    images = torch.randn(8, config.in_channels, config.image_size, config.image_size)
    labels = torch.randint(0, config.num_classes, (8,))
    return Case(model, config, (images,), labels, F.cross_entropy, jax_resnet, eval_for_inference=True)


def _unet() -> Case:
    from unet import UNet, UNetConfig

    config = UNetConfig()
    model = UNet(config)
    images = torch.randn(4, config.in_channels, config.image_size, config.image_size)
    masks = torch.randint(0, config.num_classes, (4, config.image_size, config.image_size))
    return Case(model, config, (images,), masks, F.cross_entropy, jax_unet, eval_for_inference=True)


def _dlrm() -> Case:
    from dlrm import DLRM, DLRMConfig, make_batch

    config = DLRMConfig()
    model = DLRM(config)
    dense, indices, offsets, labels = make_batch(config, 32, torch.Generator().manual_seed(1))
    return Case(model, config, (dense, indices, offsets), labels, F.binary_cross_entropy_with_logits, jax_dlrm,
                eval_for_inference=False)


CASES: dict[str, Callable[[], Case]] = {"resnet": _resnet, "unet": _unet, "dlrm": _dlrm}


def _build(name: str, dtype: torch.dtype = torch.float32) -> Case:
    torch.manual_seed(0)  # as bench.models.build
    case = CASES[name]()
    case.model.to(dtype)
    case.inputs = _cast(case.inputs, dtype)
    return case


def _cast(value, dtype: torch.dtype):
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    return value.to(dtype) if value.is_floating_point() else value


def _to_jax(value):
    """Tensors (in lists and tuples) as jax arrays of the same dtype; integer ones as (32-bit) integers."""
    if isinstance(value, list | tuple):
        return type(value)(_to_jax(v) for v in value)
    if value.is_floating_point():
        dtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[value.dtype]
        return jnp.asarray(value.detach().float().numpy()).astype(dtype)
    return jnp.asarray(value.detach().numpy())


def _params(model: nn.Module) -> dict[str, jax.Array]:
    return {name: _to_jax(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _assert_close(actual: jax.Array, expected: torch.Tensor, what: str, tol: dict[str, float] = F32) -> None:
    expected_np = expected.detach().float().numpy()
    actual_np = np.asarray(actual.astype(jnp.float32))
    assert actual_np.shape == expected_np.shape, (what, actual_np.shape, expected_np.shape)
    np.testing.assert_allclose(actual_np, expected_np, err_msg=what, **tol)


@pytest.fixture(autouse=True)
def _jax_on_cpu() -> Iterator[None]:
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_eager(name: str) -> None:
    case = _build(name)
    case.model.train(not case.eval_for_inference)
    with torch.no_grad():
        expected = case.model(*case.inputs)
    forward = jax.jit(functools.partial(case.reference.forward, config=case.config))
    actual = forward(_params(case.model), _to_jax(case.inputs))
    assert actual.dtype == jnp.float32
    _assert_close(actual, expected, "output")


def test_resnet18_forward_matches_eager() -> None:
    from resnet import RESNET_18, ResNet

    config = dataclasses.replace(RESNET_18, image_size=32)
    torch.manual_seed(0)
    model = ResNet(config).eval()
    images = torch.randn(2, config.in_channels, config.image_size, config.image_size)
    with torch.no_grad():
        expected = model(images)
    forward = jax.jit(functools.partial(jax_resnet.forward, config=config))
    _assert_close(forward(_params(model), (_to_jax(images),)), expected, "logits")


def test_unet_other_upsampling_modes_forward_matches_eager() -> None:
    from unet import UNet, UNetConfig

    config = UNetConfig(up_modes=("bilinear", "nearest"))
    torch.manual_seed(0)
    model = UNet(config).eval()
    images = torch.randn(2, config.in_channels, config.image_size, config.image_size)
    with torch.no_grad():
        expected = model(images)
    forward = jax.jit(functools.partial(jax_unet.forward, config=config))
    _assert_close(forward(_params(model), (_to_jax(images),)), expected, "logits")


def test_dlrm_empty_bags_match_eager() -> None:
    case = _build("dlrm")
    dense, indices, offsets = case.inputs
    offsets = [o.clone() for o in offsets]
    offsets[0][1] = offsets[0][2]  # bag 1 empty (bag 0 takes its ids)
    offsets[1][-1] = indices[1].numel()  # the last bag empty
    with torch.no_grad():
        expected = case.model(dense, indices, offsets)
    forward = jax.jit(functools.partial(jax_dlrm.forward, config=case.config))
    _assert_close(forward(_params(case.model), _to_jax((dense, indices, offsets))), expected, "logits")


@pytest.mark.parametrize("name", CASES)
def test_loss_buffers_and_gradients_match_eager(name: str) -> None:
    case = _build(name)
    model = case.model.train()
    params = _params(model)  # before torch's forward updates the running statistics
    torch_loss = case.torch_loss(model(*case.inputs), case.labels)
    torch_loss.backward()

    loss_fn = functools.partial(case.reference.loss, config=case.config)
    # The integer buffers (num_batches_tracked, DLRM's pair indices) are in params too, hence allow_int.
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True, allow_int=True))
    (loss, buffers), grads = grad_fn(params, (*_to_jax(case.inputs), _to_jax(case.labels)))

    _assert_close(loss, torch_loss, "loss")
    batch_norms = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    written = {n for n, _ in model.named_buffers() if n.rsplit(".", 1)[0] in batch_norms}
    assert set(buffers) == written
    torch_buffers = dict(model.named_buffers())
    for buffer_name, value in buffers.items():
        assert value.dtype == params[buffer_name].dtype, buffer_name
        _assert_close(value, torch_buffers[buffer_name], buffer_name)
    for param_name, p in model.named_parameters():
        assert grads[param_name].dtype == jnp.float32
        _assert_close(grads[param_name], p.grad, f"gradient of {param_name}", F32_GRAD)
    for buffer_name, b in model.named_buffers():
        if b.is_floating_point():
            assert not np.any(np.asarray(grads[buffer_name])), buffer_name


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_loss_matches_eager(name: str) -> None:
    case = _build(name, torch.bfloat16)
    model = case.model.train()
    params = _params(model)
    assert {p.dtype for p in params.values()} <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)}
    with torch.no_grad():
        # The model runs in bfloat16; the loss of its output in float32, as the reference computes it.
        torch_loss = case.torch_loss(model(*case.inputs).float(), case.labels)
    loss_fn = jax.jit(functools.partial(case.reference.loss, config=case.config))
    loss, _ = loss_fn(params, (*_to_jax(case.inputs), _to_jax(case.labels)))
    assert loss.dtype == jnp.float32
    _assert_close(loss, torch_loss, "bfloat16 loss", dict(rtol=BF16_LOSS_RTOL, atol=0))
