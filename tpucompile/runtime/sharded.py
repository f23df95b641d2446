"""Running one SPMD program over the devices of a mesh: torch tensors in, shards placed, results gathered.

Each argument is split by its sharding and every device of this process gets its shard (a zero-copy DLPack
import of a slice of the torch tensor where the slice is contiguous). Results come back as whole torch
tensors: a replicated one is taken from this process's first device, which costs nothing; a split one is
assembled on the host from its shards.

``DTensor`` arguments are placed from their local shard when it is exactly the part of this process's device
(one device per torch rank), and outputs that should be ``DTensor``s are built from this process's part.

Placed values are remembered per torch tensor (same object, storage and version counter), across programs:
a parameter that did not change since the last call is not sent again, and an activation a forward program
returned split is handed to the backward program as the device array it already is, when the backward
expects it laid out the same way. Each argument slot keeps its last placement until the tensor dies or the
slot moves on; every shard is counted per device for ``tpucompile.memory_stats()``.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxlib import xla_client

from tpucompile.contracts.calling_convention import (
    CONSTANT,
    INPUT,
    PART,
    RESULT,
    SEED_POSITION,
    OutputSlot,
    call_plan,
    draw_seed,
)
from tpucompile.errors import ShardingError
from tpucompile.metrics import memory_accounting
from tpucompile.runtime.transfer import shares_tensor_memory, to_buffer, to_tensor

Dims = tuple[tuple[str, ...], ...]
Index = tuple[tuple[int, int], ...]
"""The part of a tensor one device holds: (start, stop) per dimension."""

_resident: dict[int, tuple[Any, int, int, Any]] = {}
"""id(tensor) → (weak reference, version, data pointer, global jax array holding its value on the mesh)."""
atexit.register(_resident.clear)  # drop the device arrays before jax's own exit handler takes the client down


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "_local_tensor")


def _probe(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter and storage tell whether ``tensor`` changed."""
    return tensor._local_tensor if _is_dtensor(tensor) else tensor


def _remember(tensor: torch.Tensor, array: Any) -> None:
    key, probe = id(tensor), _probe(tensor)
    _resident[key] = (weakref.ref(tensor, lambda _, key=key: _resident.pop(key, None)), probe._version,
                      probe.data_ptr(), array)


def _resident_array(tensor: torch.Tensor, sharding: Any) -> Any:
    """The array ``tensor`` is already placed as with ``sharding``, or None."""
    entry = _resident.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    probe = _probe(tensor)
    if entry[1] != probe._version or entry[2] != probe.data_ptr() or entry[3].sharding != sharding:
        return None
    return entry[3]


def as_dtensor(local: torch.Tensor, device_mesh: Any, placements: Sequence[Any], shape: tuple[int, ...]) -> Any:
    """A ``DTensor`` of global ``shape`` whose part on this rank is ``local`` (a Partial placement becomes
    Replicate: the value here is already reduced)."""
    from torch.distributed.tensor import DTensor, Replicate

    placements = [Replicate() if p.is_partial() else p for p in placements]
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _spec(dims: Dims) -> PartitionSpec:
    return PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims])


def _named_index(coords: tuple[int, ...], axis_index: dict[str, int], mesh_shape: tuple[int, ...], dims: Dims,
                 shape: tuple[int, ...]) -> Index:
    """The part of a ``shape`` tensor laid out as ``dims`` that the device at mesh ``coords`` holds."""
    index = []
    for size, axes in zip(shape, dims, strict=True):
        position, count = 0, 1
        for axis in axes:
            position = position * mesh_shape[axis_index[axis]] + coords[axis_index[axis]]
            count *= mesh_shape[axis_index[axis]]
        chunk = -(-size // count)
        index.append((min(position * chunk, size), min((position + 1) * chunk, size)))
    return tuple(index)


def hlo_layout(sharding: Any, shape: tuple[int, ...], partitions: int) -> list[Index]:
    """The part of the tensor each partition holds under an XLA ``OpSharding``."""
    whole = tuple((0, size) for size in shape)
    kind = sharding.type
    if kind in (xla_client.OpSharding.Type.REPLICATED, xla_client.OpSharding.Type.MAXIMAL) or not shape:
        return [whole] * partitions
    if kind != xla_client.OpSharding.Type.OTHER:
        raise ShardingError(f"unsupported result sharding {kind}")
    tiles = list(sharding.tile_assignment_dimensions)
    if sharding.tile_assignment_devices:
        devices = np.array(list(sharding.tile_assignment_devices)).reshape(tiles)
    else:
        reshape = list(sharding.iota_reshape_dims)
        devices = np.arange(int(np.prod(reshape))).reshape(reshape).transpose(list(sharding.iota_transpose_perm))
        devices = devices.reshape(tiles)
    found: list[Index | None] = [None] * partitions
    for tile in np.ndindex(*tiles):
        index = []
        for dim, size in enumerate(shape):
            chunk = -(-size // tiles[dim])
            index.append((min(tile[dim] * chunk, size), min((tile[dim] + 1) * chunk, size)))
        found[int(devices[tile])] = tuple(index)
    if any(i is None for i in found):
        raise ShardingError("a result sharding leaves some devices without a part")
    return found  # type: ignore[return-value]


def mesh_dims(layout: Sequence[Index], shape: tuple[int, ...], mesh_axes: Sequence[tuple[str, int]]) -> Dims | None:
    """The dims (mesh axes per dimension) that lay a tensor out as ``layout``; None when no dims do (XLA
    may split a dimension over part of an axis)."""
    names = [name for name, _ in mesh_axes]
    mesh_shape = tuple(size for _, size in mesh_axes)
    axis_index = {name: i for i, name in enumerate(names)}
    coords = list(np.ndindex(*mesh_shape))
    for choice in itertools.product(range(len(shape) + 1), repeat=len(names)):
        groups = [[names[a] for a in range(len(names)) if choice[a] == dim] for dim in range(len(shape))]
        for orders in itertools.product(*[itertools.permutations(g) for g in groups]):
            dims = tuple(tuple(order) for order in orders)
            if all(_named_index(coords[p], axis_index, mesh_shape, dims, shape) == layout[p]
                   for p in range(len(coords))):
                return dims
    return None


def result_layouts(shardings: Sequence[Any], shapes: Sequence[tuple[int, ...]],
                   mesh_axes: Sequence[tuple[str, int]]) -> list[Dims | None]:
    """The dims of each result of an executable compiled for a mesh, from its output ``OpSharding``s (None
    where no dims describe it)."""
    partitions = int(np.prod([size for _, size in mesh_axes]))
    return [_layout_dims(hlo_layout(sharding, tuple(shape), partitions), tuple(shape), mesh_axes)
            for sharding, shape in zip(shardings, shapes, strict=True)]


def _replicated(layout: Sequence[Index], shape: tuple[int, ...]) -> bool:
    whole = tuple((0, size) for size in shape)
    return all(index == whole for index in layout)


def _layout_dims(layout: Sequence[Index], shape: tuple[int, ...], mesh_axes: Sequence[tuple[str, int]]
                 ) -> Dims | None:
    """The dims of a result laid out as ``layout`` (None where no dims describe it)."""
    return ((),) * len(shape) if _replicated(layout, shape) else mesh_dims(layout, shape, mesh_axes)


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in index)


class _Argument:
    """How one argument is laid over the mesh, and how a torch tensor is placed that way."""

    def __init__(self, mesh: Mesh, dims: Dims, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        dims = tuple(dims) + ((),) * (len(shape) - len(dims))
        self.replicated = not any(dims)
        self.sharding = NamedSharding(mesh, _spec(dims))
        for dim, axes in enumerate(dims):
            split = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
            if self.shape[dim] % split:
                raise ShardingError(f"dimension {dim} of size {self.shape[dim]} cannot be split {split} ways "
                                    f"over mesh axes {axes}")
        self.pieces = list(self.sharding.addressable_devices_indices_map(self.shape).items())

    def place(self, tensor: torch.Tensor, use: str = memory_accounting.INPUTS) -> Any:
        """A global jax array whose shards on this process's devices hold ``tensor``'s parts (counted as
        ``use`` while they live)."""
        array = jax.make_array_from_single_device_arrays(self.shape, self.sharding, self._shards(tensor.detach()))
        _count(array, use, shared=shares_tensor_memory(tensor, next(iter(array.devices()))))
        return array

    def _shards(self, tensor: torch.Tensor) -> list[Any]:
        if _is_dtensor(tensor):
            local = tensor._local_tensor
            if len(self.pieces) == 1:
                device, index = self.pieces[0]
                if tuple(local.shape) == tuple(len(range(self.shape[d])[s]) for d, s in enumerate(index)):
                    return [to_buffer(local, device)]
            tensor = tensor.full_tensor()
        if self.replicated:
            return [to_buffer(tensor, device) for device, _ in self.pieces]
        return [to_buffer(tensor[index], device) for device, index in self.pieces]


class _Result:
    """How one result comes back: its parts on this process's devices, gathered into a torch tensor."""

    def __init__(self, hlo_sharding: Any, shape: tuple[int, ...], dtype: torch.dtype, mesh: Mesh,
                 devices: Sequence[Any], mesh_axes: Sequence[tuple[str, int]], keep: bool) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.keep = keep
        """Remember the device array of each value returned (another program is likely to take it)."""
        layout = hlo_layout(hlo_sharding, self.shape, len(devices))
        self.replicated = _replicated(layout, self.shape)
        local = {d for d in mesh.devices.flat if d.process_index == d.client.process_index()}
        seen: set[Index] = set()
        self.pieces: list[tuple[Any, Index]] = []
        for device, index in zip(devices, layout, strict=True):
            if device in local and index not in seen:
                seen.add(index)
                self.pieces.append((device, index))
        self.dims = _layout_dims(layout, self.shape, mesh_axes)
        self.sharding = NamedSharding(mesh, _spec(self.dims)) if self.dims is not None else None
        self.complete = self.replicated or _covers(self.pieces, self.shape)

    def local(self, shards: Sequence[Any]) -> torch.Tensor:
        """This process's part (the whole value when it is replicated), for a ``DTensor`` output."""
        if self.replicated or len(self.pieces) != 1:
            return self.gather(shards)
        device = self.pieces[0][0]
        return to_tensor(next(s for s in shards if next(iter(s.devices())) == device))

    def gather(self, shards: Sequence[Any]) -> torch.Tensor:
        """The whole value from the per-device shards of this result."""
        if self.replicated:
            out = to_tensor(shards[0])
            # torch's tensor holds the first device's shard: counted while its storage lives
            memory_accounting.device_memory(self.pieces[0][0]).hold(out.untyped_storage(), memory_accounting.OUTPUTS,
                                                                    out.nbytes)
            if self.keep:
                kept = jax.make_array_from_single_device_arrays(self.shape, self.sharding, shards)
                _remember(out, kept)
                _count(kept, memory_accounting.OUTPUTS, skip=next(iter(shards[0].devices())))
            return out
        if not self.complete:
            raise ShardingError("a split result is spread over other processes' devices and cannot be gathered "
                                "here")
        by_device = {next(iter(shard.devices())): shard for shard in shards}
        out = torch.empty(self.shape, dtype=self.dtype)
        for device, index in self.pieces:
            out[_slices(index)] = to_tensor(by_device[device])
        if self.keep and self.sharding is not None:
            devices = self.sharding.addressable_devices_indices_map(self.shape)
            kept = jax.make_array_from_single_device_arrays(self.shape, self.sharding,
                                                            [by_device[d] for d in devices])
            _remember(out, kept)
            _count(kept, memory_accounting.OUTPUTS)
        return out


def _count(array: Any, use: str, shared: bool = False, skip: Any = None) -> None:
    """Count each device's shard of ``array`` on that device as ``use`` while it lives (the array holds
    its shards; the arrays it was made from are not them). ``skip``: a device whose shard a torch tensor
    already holds and counts."""
    for shard in array.addressable_shards:
        if shard.device != skip:
            data = shard.data
            memory_accounting.device_memory(shard.device).hold(data, use, data.nbytes, shared=shared)


def _covers(pieces: Sequence[tuple[Any, Index]], shape: tuple[int, ...]) -> bool:
    total = sum(int(np.prod([stop - start for start, stop in index])) for _, index in pieces)
    return total == int(np.prod(shape))


class ShardedExecutable:
    """Runs one loaded SPMD executable on a boxed list of torch arguments (the multi-device ``GraphExecutable``)."""

    def __init__(
        self,
        loaded: Any,
        devices: Sequence[Any],
        mesh_axes: Sequence[tuple[str, int]],
        arg_dims: Sequence[Dims],
        arg_shapes: Sequence[tuple[int, ...]],
        result_specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
        kept_results: Sequence[bool],
        input_positions: Sequence[int],
        output_plan: Sequence[OutputSlot],
        constants: Sequence[torch.Tensor] = (),
    ) -> None:
        self._boxed_call = True  # see GraphExecutable
        self.loaded = loaded
        names = tuple(name for name, _ in mesh_axes)
        shape = tuple(size for _, size in mesh_axes)
        self.mesh = Mesh(np.array(list(devices), dtype=object).reshape(shape), names)
        self.input_positions = list(input_positions)
        self.output_plan = list(output_plan)
        self._plan = call_plan(self.output_plan)
        self.constants = list(constants)
        self.args = [_Argument(self.mesh, d, s) for d, s in zip(arg_dims, arg_shapes, strict=True)]
        self.results = [
            _Result(hlo, s, dtype, self.mesh, devices, mesh_axes, keep)
            for hlo, (s, dtype), keep in zip(loaded.get_output_shardings(), result_specs, kept_results, strict=True)
        ]
        self._placed: list[tuple | None] = [None] * len(self.input_positions)
        self.dtensor_outputs: dict[int, tuple[Any, Sequence[Any]]] = {}
        """Output position → (device mesh, placements) of the outputs that come back as ``DTensor``s."""
        self.placements = 0
        """How many arguments were placed on the devices (not reused); tests read it."""

    @property
    def result_dims(self) -> list[Dims | None]:
        """The mesh axes splitting each result (None: split in a way no dims describe)."""
        return [r.dims for r in self.results]

    def arguments(self, args: Sequence[Any]) -> list[Any]:
        """The program's arguments as global jax arrays, reusing the placed shards of unchanged tensors."""
        first_constant = len(args)
        if self.constants:
            args = [*args, *self.constants]
        arrays = []
        for slot, position in enumerate(self.input_positions):
            layout = self.args[slot]
            if position == SEED_POSITION:
                arrays.append(layout.place(draw_seed()))
                continue
            tensor = args[position]
            probe = _probe(tensor)
            entry = self._placed[slot]
            if (
                entry is not None
                and entry[0]() is tensor
                and entry[1] == probe._version
                and entry[2] == probe.data_ptr()
            ):
                arrays.append(entry[3])
                continue
            if tuple(tensor.shape) != layout.shape:
                raise ShardingError(f"argument {position} has shape {tuple(tensor.shape)}, the program was "
                                    f"compiled for {layout.shape}")
            array = _resident_array(tensor, layout.sharding)
            if array is None:
                use = memory_accounting.argument_use(position >= first_constant,
                                                     isinstance(tensor, torch.nn.Parameter))
                array = layout.place(tensor, use)
                self.placements += 1
                _remember(tensor, array)
            self._placed[slot] = (weakref.ref(tensor, self._release(slot)), probe._version, probe.data_ptr(), array)
            arrays.append(array)
        return arrays

    def _release(self, slot: int) -> Any:
        """The callback that lets slot ``slot``'s placement go when its tensor dies (unless the slot moved on)."""
        placed = self._placed

        def release(ref: Any) -> None:
            entry = placed[slot]
            if entry is not None and entry[0] is ref:
                placed[slot] = None

        return release

    def __call__(self, args: list[Any]) -> list[Any]:
        shards = self.loaded.execute_sharded(self.arguments(args)).disassemble_into_single_device_arrays()
        outputs = []
        stacks: dict[int, torch.Tensor] = {}
        for position, (kind, value) in enumerate(self._plan):
            if kind == PART and position not in self.dtensor_outputs:  # a view of the gathered stacked result
                index, part = value
                if index not in stacks:
                    stacks[index] = self.results[index].gather(shards[index])
                outputs.append(stacks[index][part])
            elif kind == RESULT and position in self.dtensor_outputs:
                result = self.results[value]
                outputs.append(as_dtensor(result.local(shards[value]), *self.dtensor_outputs[position],
                                          result.shape))
            elif kind == RESULT:
                outputs.append(self.results[value].gather(shards[value]))
            elif kind == INPUT:
                outputs.append(args[value])
            elif kind == CONSTANT:
                outputs.append(value)
            elif kind == PART:
                raise ShardingError("a layer of a stacked result cannot be returned as a DTensor; compile with "
                                    "stacked_layer_outputs=False")
            else:
                raise ShardingError(f"output kind {kind} is not supported in a sharded program")
        return outputs
