"""PyTorch's ``_foreach_*`` ops, decomposed into one ordinary op per list element.

The multi-tensor optimizers (``torch.optim`` with ``foreach=True``, PyTorch's default on CUDA, XPU and
PrivateUse1 devices), gradient clipping (``clip_grad_norm_``) and ``zero_grad`` call ops that take lists of
tensors. Their eager "slow path" applies the per-tensor op to each element, with that op's dtype promotion;
so does this table, below AOTAutograd, which gives XLA the same per-element ops that the single-tensor loop
would and Dynamo a trace of a few list ops instead of a Python loop over every parameter.

Each functional overload is decomposed by its schema: a ``Tensor[]`` or ``Scalar[]`` argument gives the
element at the list position, any other argument is passed whole. The exceptions are named in
``_PER_ELEMENT``: reductions (``norm``, ``max``, ``powsum``), ``zero``, ``copy``, ``maximum``/``minimum`` with
a scalar (``clamp_min``/``clamp_max``), a scalar base (``pow.ScalarAndTensor``) and the ``Tensor`` scalars of
``addcmul``/``addcdiv`` (a 1-d tensor with one scalar per element).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def _norm(tensor: torch.Tensor, ord: Any = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    return aten.linalg_vector_norm.default(tensor, ord, dtype=dtype)


def _powsum(tensor: torch.Tensor, ord: Any = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum(|x| ** ord)``, the square of the 2-norm without its root (what a global norm adds up)."""
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor.abs().pow(ord).sum()


def _maximum(tensor: torch.Tensor, other: Any) -> torch.Tensor:
    return aten.maximum.default(tensor, other) if isinstance(other, torch.Tensor) else aten.clamp_min(tensor, other)


def _minimum(tensor: torch.Tensor, other: Any) -> torch.Tensor:
    return aten.minimum.default(tensor, other) if isinstance(other, torch.Tensor) else aten.clamp_max(tensor, other)


def _scaled_product(combine: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """``addcmul``/``addcdiv`` with ``value`` positional, as the foreach schema has it; a 0-d tensor ``value``
    (an element of the ``Tensor`` overload's scalars) multiplies the product, as the eager path's scalar would."""
    packet = getattr(aten, name)

    def per_element(tensor: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, value: Any = 1
                    ) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return tensor + value * combine(tensor1, tensor2)
        return packet(tensor, tensor1, tensor2, value=value)

    return per_element


def _copy(tensor: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return aten.copy.default(tensor, source, non_blocking)


# Per-element ops whose name or arguments differ from the foreach op's; the rest call ``aten.<name>``.
_PER_ELEMENT: dict[str, Callable[..., torch.Tensor]] = {
    "norm": _norm,
    "powsum": _powsum,
    "max": lambda tensor: aten.max.default(tensor),
    "zero": lambda tensor: aten.zeros_like.default(tensor),
    "copy": _copy,
    "maximum": _maximum,
    "minimum": _minimum,
    "addcmul": _scaled_product(torch.mul, "addcmul"),
    "addcdiv": _scaled_product(torch.div, "addcdiv"),
}


def _element_op(name: str) -> Callable[..., torch.Tensor]:
    if name in _PER_ELEMENT:
        return _PER_ELEMENT[name]
    return getattr(aten, name)  # the packet: the overload follows the element's argument types


def _decomposition(overload: torch._ops.OpOverload) -> Callable[..., list[torch.Tensor]]:
    """The per-element form of one functional ``_foreach_*`` overload, driven by its schema."""
    schema = overload._schema
    element_op = _element_op(schema.name.removeprefix("aten::_foreach_"))
    # Which arguments are lists (indexed per element); the Tensor scalars of addcmul/addcdiv are indexed too.
    per_element = [str(argument.type) in ("List[Tensor]", "List[number]", "List[Scalar]")
                   or (argument.name == "scalars" and str(argument.type) == "Tensor")
                   for argument in schema.arguments]
    names = [argument.name for argument in schema.arguments]
    keyword_only = [argument.kwarg_only for argument in schema.arguments]

    def per_element_calls(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        values = list(args) + [kwargs.get(name, argument.default_value)
                               for name, argument in zip(names[len(args):], schema.arguments[len(args):],
                                                         strict=True)]
        length = next(len(value) for value, listed in zip(values, per_element, strict=True)
                      if listed and not isinstance(value, torch.Tensor))
        results = []
        for index in range(length):
            positional, keywords = [], {}
            for name, value, listed, keyword in zip(names, values, per_element, keyword_only, strict=True):
                element = value[index] if listed else value
                if keyword:
                    keywords[name] = element
                else:
                    positional.append(element)
            results.append(element_op(*positional, **keywords))
        return results

    per_element_calls.__name__ = f"foreach_{schema.name.removeprefix('aten::_foreach_')}_per_element"
    return per_element_calls


@functools.cache
def foreach_decompositions() -> dict[torch._ops.OpOverload, Callable[..., list[torch.Tensor]]]:
    """Every functional ``_foreach_*`` overload this PyTorch has (``out`` and in-place forms excluded:
    AOTAutograd's functionalization turns the in-place ones into these)."""
    table = {}
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.removeprefix("aten::")
        if not name.startswith("_foreach_") or name.endswith("_") or schema.overload_name.endswith("out"):
            continue
        overload = getattr(getattr(aten, name), schema.overload_name or "default")
        table[overload] = _decomposition(overload)
    return table
