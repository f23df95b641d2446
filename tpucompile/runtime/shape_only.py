"""What a compile-only graph hands back to AOTAutograd: outputs with the program's shapes and dtypes, made
from the program's types without running anything, so that the user's step (loss, backward, optimiser) runs
to the end and every graph of it is compiled.

On ``meta`` inputs (a model built under ``torch.device("meta")``) the outputs are meta tensors: no memory is
spent on values. On real inputs (``compile_only=True`` given for a model that exists) they are uninitialised
tensors on the inputs' device, so that autograd and the optimiser accept them; their values mean nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tpucompile.contracts.calling_convention import CONSTANT, INPUT, PART, RESULT, TRIMMED, OutputSlot, call_plan


class ShapeOnlyExecutable:
    """Stands for a graph compiled only for other targets: a call returns meta tensors of the result types
    (a data-dependent result keeps its padded size), inputs passed through as they are, constants."""

    def __init__(self, output_plan: Sequence[OutputSlot], result_types: Sequence[tuple[tuple[int, ...], Any]],
                 devices: Sequence[torch.device | None]) -> None:
        self._boxed_call = True
        self._plan = call_plan(output_plan)
        self._result_types = list(result_types)
        self._devices = list(devices)
        """Per output, the device the traced graph gives it (a meta model's optimiser keeps its step counts on
        the CPU, and AOTAutograd copies each updated one back into its tensor); None: the inputs'."""

    def __call__(self, args: list[Any]) -> list[Any]:
        default = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("meta"))
        outputs: list[Any] = []
        stacks: dict[int, torch.Tensor] = {}
        for position, (kind, value) in enumerate(self._plan):
            device = (self._devices[position] if position < len(self._devices) else None) or default
            if kind == RESULT:
                outputs.append(self._empty(value, device))
            elif kind == TRIMMED:
                outputs.append(self._empty(value[0], device))
            elif kind == PART:  # every layer a view of one stacked tensor, as the executables return them
                index, part = value
                if index not in stacks:
                    stacks[index] = self._empty(index, device)
                outputs.append(stacks[index][part])
            elif kind == INPUT:
                outputs.append(args[value])
            elif kind == CONSTANT:
                outputs.append(value)
        return outputs

    def _empty(self, index: int, device: torch.device) -> torch.Tensor:
        shape, dtype = self._result_types[index]
        return torch.empty(shape, dtype=dtype, device=device)
