"""Serve a program ``tpucompile.export`` wrote, with numpy and jax only: no torch in the serving process.

An export directory holds ``manifest.json``, the weights (``weights.safetensors``) and one or more programs in
jax.export's serialisation. A program of static sizes takes the weights and the user inputs. A program made
for a dynamic dimension serves every size up to its bucket: the caller pads each input with zeros at the end
of its dynamic dimensions up to the bucket's sizes, passes each size symbol's actual value as an ``int32``
scalar after the tensors, and cuts each result back to its actual shape; inside the program the dimensions are
marked with their actual sizes, so reductions and products ignore the padding. ``ServedProgram`` does all of
that, picking the smallest bucket that holds the call.

    from tpucompile.serving import load_served
    model = load_served("out/llama")          # weights placed on the device once
    logits, = model(np.array(tokens))         # numpy in, numpy out

This module imports nothing of tpucompile that needs torch (``python -c "import tpucompile.serving"`` loads
no torch).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FORMAT = "tpucompile-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class ServingError(ValueError):
    """A call the exported program cannot serve (wrong count, dtype or shape; a size past every bucket), or an
    export directory this loader cannot read."""


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the export directory ``path``, checked to be one this loader reads."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as stream:
            manifest = json.load(stream)
    except FileNotFoundError:
        raise ServingError(f"{path} holds no {MANIFEST}: not a directory tpucompile.export wrote") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ServingError(f"{file} is format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                           f"this loader reads {FORMAT!r} version {FORMAT_VERSION}")
    return manifest


_POLYNOMIAL = re.compile(r"[A-Za-z_0-9+\-* ()]+")


def size_of(expression: int | str, sizes: Mapping[str, int]) -> int:
    """A dimension of the manifest at ``sizes``: an int, or a polynomial in the size symbols (``2*s0 + 1``;
    the exporter writes no other kind)."""
    if isinstance(expression, int):
        return expression
    if not isinstance(expression, str) or not _POLYNOMIAL.fullmatch(expression):
        raise ServingError(f"dimension {expression!r} of the manifest is not a polynomial of the sizes")
    try:  # names, digits, + - * and parentheses only: nothing but arithmetic on the sizes can run
        return int(eval(expression, {"__builtins__": {}}, dict(sizes)))
    except Exception as error:  # a name the manifest does not define, a call of a number...
        raise ServingError(f"dimension {expression!r} of the manifest cannot be evaluated: {error}") from None


class ServedProgram:
    """The exported model as a function of numpy arrays (the user inputs, in order) returning the list of its
    outputs as numpy arrays. Weights are read and placed on jax's default device once."""

    def __init__(self, path: str | os.PathLike) -> None:
        import jax

        self.path = os.fspath(path)
        self.manifest = read_manifest(path)
        self._wide = any(np.dtype(entry["dtype"]).itemsize == 8
                         for entry in (*self.manifest["inputs"], *self.manifest["outputs"]))
        stored = read_weights(os.path.join(self.path, self.manifest["weights_file"]))
        with jax.enable_x64(self._wide):
            self.weights = {name: jax.device_put(value) for name, value in stored.items()}
            """Each weight on the device, by its name in the weights file (the manifest's ``weight``)."""
        self.inputs = [entry for entry in self.manifest["inputs"] if entry["kind"] == "user_input"]
        self.symbols = list(self.manifest["symbols"])
        self._programs: dict[str, Any] = {}

    def __call__(self, *args: Any) -> list[np.ndarray]:
        import jax

        arrays = [np.asarray(a) for a in args]
        if len(arrays) != len(self.inputs):
            raise ServingError(f"the exported program takes {len(self.inputs)} inputs "
                               f"({', '.join(e['name'] for e in self.inputs)}), got {len(arrays)}")
        sizes = self._sizes(arrays)
        program = self._program_for(sizes)
        bucket = program["sizes"]
        user = iter(arrays)
        call_args: list[Any] = []
        for entry in self.manifest["inputs"]:
            if entry["kind"] == "weight":
                call_args.append(self.weights[entry["weight"]])
            elif entry["kind"] == "user_input":
                call_args.append(_padded(next(user), [size_of(d, bucket) for d in entry["shape"]]))
            else:  # the actual value of a size symbol
                call_args.append(np.int32(sizes[entry["symbol"]]))
        with jax.enable_x64(self._wide):
            results = self._exported(program["file"]).call(*call_args)
        outputs = []
        for entry, result in zip(self.manifest["outputs"], results, strict=True):
            value = np.asarray(result)
            actual = [size_of(d, sizes) for d in entry["shape"]]
            outputs.append(value[tuple(slice(0, n) for n in actual)] if list(value.shape) != actual else value)
        return outputs

    def _sizes(self, arrays: Sequence[np.ndarray]) -> dict[str, int]:
        """Each size symbol's value in this call, with every input checked against its dtype and shape."""
        sizes: dict[str, int] = {}
        for entry, array in zip(self.inputs, arrays, strict=True):
            if array.dtype != np.dtype(entry["dtype"]):
                raise ServingError(f"input {entry['name']} must be {entry['dtype']}, got {array.dtype}")
            if array.ndim != len(entry["shape"]):
                raise ServingError(f"input {entry['name']} must have {len(entry['shape'])} dimensions "
                                   f"{entry['shape']}, got shape {list(array.shape)}")
            for dim, size in enumerate(entry["shape"]):
                if isinstance(size, str) and size in self.manifest["symbols"]:
                    sizes.setdefault(size, int(array.shape[dim]))
        for entry, array in zip(self.inputs, arrays, strict=True):
            expected = [size_of(d, sizes) for d in entry["shape"]]
            if list(array.shape) != expected:
                raise ServingError(f"input {entry['name']} must have shape {entry['shape']} = {expected} here, "
                                   f"got {list(array.shape)}")
        for name, symbol in self.manifest["symbols"].items():
            low, high = symbol["min"], symbol["max"]
            if sizes[name] < low or (high is not None and sizes[name] > high):
                raise ServingError(f"size {name} ({', '.join(symbol['dims'])}) is {sizes[name]}; the program was "
                                   f"exported for {low} to {high}")
        return sizes

    def _program_for(self, sizes: Mapping[str, int]) -> dict[str, Any]:
        """The program of the smallest bucket holding ``sizes`` (for static programs, the one program)."""
        fitting = [p for p in self.manifest["programs"] if all(sizes[s] <= p["sizes"][s] for s in self.symbols)]
        if not fitting:
            largest = {s: max(p["sizes"][s] for p in self.manifest["programs"]) for s in self.symbols}
            raise ServingError(f"sizes {dict(sizes)} exceed every exported bucket (the largest: {largest})")
        return min(fitting, key=lambda p: tuple(p["sizes"][s] for s in self.symbols))

    def _exported(self, file: str) -> Any:
        import jax

        if file not in self._programs:
            with open(os.path.join(self.path, file), "rb") as stream:
                self._programs[file] = jax.export.deserialize(bytearray(stream.read()))
        return self._programs[file]


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}


def read_weights(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as numpy arrays, bfloat16 included (as ``ml_dtypes.bfloat16``, which
    ``safetensors.numpy`` does not read)."""
    import ml_dtypes  # noqa: F401  (makes np.dtype("bfloat16") known)
    import safetensors

    with open(file, "rb") as stream:
        entries = safetensors.deserialize(stream.read())
    arrays = {}
    for name, entry in entries:
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ServingError(f"weight {name} in {file} has dtype {entry['dtype']}, which this loader does not read")
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        arrays[name] = np.frombuffer(entry["data"], dtype=dtype).reshape(entry["shape"])
    return arrays


def _padded(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``array`` with zeros at the end of each dimension up to ``shape``."""
    if list(array.shape) == list(shape):
        return array
    return np.pad(array, [(0, target - size) for size, target in zip(array.shape, shape, strict=True)])


def load_served(path: str | os.PathLike) -> ServedProgram:
    """The program exported to ``path``, callable on numpy arrays (see the module doc)."""
    return ServedProgram(path)


def bucket_grid(buckets: Mapping[str, Sequence[int]]) -> list[dict[str, int]]:
    """Every combination of one bucket per symbol (one program each)."""
    names = list(buckets)
    return [dict(zip(names, combination, strict=True))
            for combination in itertools.product(*(buckets[n] for n in names))]
