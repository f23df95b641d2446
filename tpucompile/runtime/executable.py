"""The callable handed back to AOTAutograd: torch tensors in, one PJRT execute, torch tensors out.

This is the per-call hot path, so it does the least Python it can: input positions and the output plan are
precomputed lists, and an input whose tensor already crossed to the device reuses that device buffer instead
of being imported again (``runtime/resident.py`` says when an entry is still valid): weights between steps,
and in training the weights and saved activations a backward receives from its forward. A caller that hands
results straight to another program (a training forward's saved values, which only its backward reads) can
ask for them as device buffers (``call_keeping``): no torch tensor is made for them, and a device buffer among
the arguments goes to the program as it is.

A program may take over some arguments (donation: XLA writes a result into the argument's memory). Such a
slot never gets a buffer some other party still reads: a device buffer is handed over only when the caller
says it is the last reader (``run(..., donate=True)``: the backward of a graph autograd will not run again),
else a copy; a torch tensor crosses as a copy of the runtime's own that nothing remembers (an import without
a copy would hand the program torch's memory).

Every buffer kept here is counted for ``tpucompile.memory_stats()`` where it is made (an import, a result
exported or kept) and taken off by a weak reference's callback when it dies: one small object per buffer
made, nothing per buffer reused.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tpucompile.contracts.calling_convention import (
    CONSTANT,
    INPUT,
    PART,
    RESULT,
    SEED_POSITION,
    TRIMMED,
    OutputSlot,
    call_plan,
    draw_seed,
)
from tpucompile.metrics import memory_accounting
from tpucompile.runtime.resident import resident_buffers, shares_host_memory
from tpucompile.runtime.transfer import copy_buffer, shares_tensor_memory, to_buffer, to_tensor


class GraphExecutable:
    """Runs one loaded executable on a boxed list of arguments."""

    def __init__(
        self,
        loaded: Any,
        device: Any,
        input_positions: Sequence[int],
        output_plan: Sequence[OutputSlot],
        constants: Sequence[torch.Tensor] = (),
        result_count: int | None = None,
        input_aliases: Sequence[int | None] = (),
    ) -> None:
        self._boxed_call = True  # AOTAutograd passes the arguments as one list (an instance
        # attribute, so that the wrappers Dynamo puts around a backward copy it with the __dict__)
        self.loaded = loaded
        self.device = device
        self.input_positions = list(input_positions)
        self.output_plan = list(output_plan)
        self._plan = call_plan(self.output_plan)
        self.constants = list(constants)
        self._resident = resident_buffers(device)
        self._imported: list[Any] = [None] * len(self.input_positions)
        """Per argument slot, the buffer last imported for it: what keeps it in the resident table, until the
        next import for the slot or the death of the tensor it was imported from (``_watch``)."""
        self._watches: list[Any] = [None] * len(self.input_positions)
        """Per argument slot, a weak reference to the tensor of the slot's buffer, whose callback lets the
        buffer go: Dynamo keeps a compiled graph (and this executable) for the life of the process, so a
        deleted model's parameters must not wait for the graph's next call to be freed."""
        self._shares_memory = shares_host_memory(device)
        self._memory = memory_accounting.device_memory(device)
        """Where this executable counts the buffers it keeps (``tpucompile.memory_stats()``)."""
        self._result_bytes: list[int] | None = None
        """The bytes of each program result, read from the first results (the program's shapes are fixed)."""
        self.donated_slots = frozenset(slot for slot, alias in enumerate(input_aliases) if alias is not None)
        """The argument slots the program takes over."""
        self.program_key: str | None = None
        """The program cache key this executable was built from, when it can be rebuilt from it alone."""
        self._results_per_output = _results_per_output(self._plan, result_count)
        self._results_in_order = self._results_per_output is not None and None not in self._results_per_output

    def buffers(self, args: Sequence[Any], donate: bool = False) -> list[Any]:
        """Device buffers of the program's arguments, reusing those of unchanged tensors; with ``donate`` the
        device buffers among them in donated slots are handed over as they are (the caller reads them no more)."""
        first_constant = len(args)
        if self.constants:
            args = [*args, *self.constants]
        device = self.device
        resident = self._resident
        imported = self._imported
        donated = self.donated_slots
        buffers = []
        for slot, position in enumerate(self.input_positions):
            if position == SEED_POSITION:
                buffers.append(to_buffer(draw_seed(), device))
                continue
            tensor = args[position]
            if donated and slot in donated:
                buffers.append(self._donated_buffer(tensor, donate))
                continue
            if not isinstance(tensor, torch.Tensor):  # a device buffer another program returned (call_keeping)
                buffers.append(tensor)
                continue
            buffer = resident.get(tensor)
            if buffer is None:
                buffer = self._imported_buffer(tensor, position >= first_constant)
                imported[slot] = buffer
                self._watch(slot, tensor)
            buffers.append(buffer)
        return buffers

    def _watch(self, slot: int, tensor: torch.Tensor) -> None:
        """Drop slot ``slot``'s buffer when ``tensor`` dies, unless the slot has a newer one by then."""
        watches, imported = self._watches, self._imported

        def release(ref: Any, slot: int = slot) -> None:
            if watches[slot] is ref:
                watches[slot] = None
                imported[slot] = None

        watches[slot] = weakref.ref(tensor, release)

    def _imported_buffer(self, tensor: torch.Tensor, constant: bool) -> Any:
        """A new buffer of ``tensor``, remembered for the tensor and counted as held while it lives."""
        buffer = to_buffer(tensor, self.device)
        aliases = shares_tensor_memory(tensor, self.device) and buffer.unsafe_buffer_pointer() == tensor.data_ptr()
        self._resident.remember(tensor, buffer, imported=True, shares_memory=self._shares_memory and aliases)
        use = memory_accounting.argument_use(constant, isinstance(tensor, torch.nn.Parameter))
        self._memory.hold(buffer, use, tensor.nbytes, shared=aliases)
        return buffer

    def _donated_buffer(self, value: Any, donate: bool) -> Any:
        """The buffer a donated slot gets: ``value`` itself only when it is a device buffer handed over, else
        a buffer of the runtime's own (a tensor imported without a copy shares torch's memory, which a program
        must never write)."""
        if isinstance(value, torch.Tensor):
            buffer = to_buffer(value, self.device)
            return copy_buffer(buffer, self.device) if shares_tensor_memory(value, self.device) else buffer
        if donate:
            memory_accounting.release(value)  # its memory becomes the program's
            return value
        return copy_buffer(value, self.device)

    def _exported(self, result: Any) -> torch.Tensor:
        """A program result as a torch tensor, remembered so that passing it back in costs no import."""
        tensor = to_tensor(result)
        self._resident.remember(tensor, result, shares_memory=self._shares_memory, imported=False)
        # Counted while its storage lives: torch hands results on as other tensors over the same memory
        # (autograd's gradients), and a storage's Python object lives exactly as long as the memory.
        self._memory.hold(tensor.untyped_storage(), memory_accounting.OUTPUTS, tensor.nbytes)
        return tensor

    def _kept(self, results: list[Any], index: int) -> Any:
        """A program result handed on as a device buffer (a forward's saved value), counted while it lives."""
        sizes = self._result_bytes
        if sizes is None:
            sizes = self._result_bytes = [result.nbytes for result in results]
        result = results[index]
        self._memory.hold(result, memory_accounting.SAVED_ACTIVATIONS, sizes[index])
        return result

    def __call__(self, args: list[Any]) -> list[Any]:
        return self._outputs(self.loaded.execute(self.buffers(args)), args, len(self.output_plan))

    def run(self, args: list[Any], donate: bool) -> list[Any]:
        """A call whose caller says whether the device buffers among ``args`` are read by nothing after it
        (``donate``), so that donated slots may take them over."""
        return self._outputs(self.loaded.execute(self.buffers(args, donate)), args, len(self.output_plan))

    @property
    def returns_results_in_order(self) -> bool:
        """Whether the outputs are the program's results, one each, in order (no argument returned as it is,
        no result trimmed): what ``execute`` gives then maps one to one onto the outputs."""
        return self._results_in_order

    @property
    def results_per_output(self) -> list[int | None] | None:
        """Per output, the program result it is (None for an argument returned as it is or a constant), when
        the results are whole and in output order; None otherwise (a result trimmed or split): what lets a
        caller of ``execute`` supply those outputs itself."""
        return self._results_per_output

    def execute(self, args: list[Any], donate: bool = False) -> list[Any]:
        """The program's results as device buffers, neither exported nor counted: for a caller that turns
        each into a tensor of its own at once (``export`` for one it hands on as it is); ``donate`` as for
        ``run``."""
        return self.loaded.execute(self.buffers(args, donate))

    def export(self, result: Any) -> torch.Tensor:
        """One of ``execute``'s results as the torch tensor a call would have returned for it."""
        return self._exported(result)

    def call_keeping(self, args: list[Any], first_kept: int) -> list[Any]:
        """Like a call, but the outputs from position ``first_kept`` on that are program results come back as
        device buffers, for a caller that only passes them to another program of this device."""
        return self._outputs(self.loaded.execute(self.buffers(args)), args, first_kept)

    def _outputs(self, results: list[Any], args: list[Any], first_kept: int) -> list[Any]:
        if self._results_in_order:
            exported = self._exported
            if first_kept >= len(results):
                return [exported(result) for result in results]
            return [*(exported(result) for result in results[:first_kept]),
                    *(self._kept(results, index) for index in range(first_kept, len(results)))]
        outputs = []
        stacks: dict[int, torch.Tensor] = {}
        for position, (kind, value) in enumerate(self._plan):
            if kind == PART:  # a layer of a stacked result: a view of the one tensor made of it
                index, part = value
                stack = stacks.get(index)
                if stack is None:
                    stack = stacks[index] = self._exported(results[index])
                outputs.append(stack[part])
            elif kind == RESULT:
                outputs.append(self._exported(results[value]) if position < first_kept else self._kept(results, value))
            elif kind == INPUT:
                outputs.append(args[value])
            elif kind == TRIMMED:
                index, trim = value
                tensor = to_tensor(results[index])
                nbytes = tensor.nbytes
                for dim, size_index in trim:
                    tensor = tensor.narrow(dim, 0, int(to_tensor(results[size_index])))
                self._memory.hold(tensor.untyped_storage(), memory_accounting.OUTPUTS, nbytes)
                outputs.append(tensor)
            else:
                outputs.append(value)
        return outputs


def _results_per_output(plan: list[tuple[int, Any]], result_count: int | None) -> list[int | None] | None:
    """``GraphExecutable.results_per_output`` from its call plan."""
    per_output = [value if kind == RESULT else None for kind, value in plan]
    if any(kind not in (RESULT, INPUT, CONSTANT) for kind, _ in plan):
        return None
    results = [index for index in per_output if index is not None]
    if results != list(range(len(results))) or (result_count is not None and result_count != len(results)):
        return None
    return per_output
