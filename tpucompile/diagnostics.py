"""Where a graph node came from in the user's program, and how to describe it in a message.

Dynamo records a Python stack trace on every FX node (``node.meta["stack_trace"]``) and AOTAutograd
carries it onto the ATen nodes it traces. The innermost frame is the user's line that produced the op.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        text = f"{self.file}:{self.line} in {self.function}"
        return f"{text}: {self.code}" if self.code else text


def source_location(node: torch.fx.Node) -> SourceLocation | None:
    """The innermost user frame recorded for ``node``, or None when the node has no trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = _FRAME.match(lines[index])
        if match:
            code = lines[index + 1].strip() if index + 1 < len(lines) else ""
            if code.startswith("File "):
                code = ""
            return SourceLocation(match["file"], int(match["line"]), match["func"].strip(), code)
    return None


def describe_value(value: object) -> str:
    """A short type description of a node argument: ``float32[2, 3]``, ``int``, ``None``…"""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val", value)
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe_value(v) for v in value) + "]"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)
    return type(value).__name__


_MODULE_ROOT = re.compile(r"""^[LG]\[['"][^'"]+['"]\]\.?""")


def submodule_path(source: str) -> str:
    """A module's path below the compiled one, from the source Dynamo records for it in ``nn_module_stack``
    (``L['self'].layers.0`` -> ``layers.0``; the compiled module itself -> "")."""
    return _MODULE_ROOT.sub("", source)


def module_location(node: torch.fx.Node) -> str | None:
    """The innermost module that made ``node`` (Dynamo's ``nn_module_stack``), as ``submodule 0 (Conv2d)``:
    what a message can name when the stack trace names no line, as for an ``nn.Sequential`` of torch's own
    modules, whose every frame is inside torch and so left out of the trace."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    name = getattr(kind, "__qualname__", str(kind))
    path = submodule_path(str(path))
    return f"submodule {path} ({name})" if path else f"the compiled module ({name})"


def describe_node(node: torch.fx.Node) -> str:
    """``aten.add.Tensor(float32[2, 3], 1.0) at model.py:12 in forward: y = x + 1``"""
    args = [describe_value(a) for a in node.args]
    args += [f"{k}={describe_value(v)}" for k, v in node.kwargs.items()]
    text = f"{op_name(node.target)}({', '.join(args)})"
    if "val" in node.meta:
        text += f" -> {describe_value(node.meta['val'])}"
    where = source_location(node)
    if where:
        return f"{text} at {where}"
    module = module_location(node)
    return f"{text} in {module} (no source line recorded)" if module else f"{text} (no source location recorded)"


def op_name(target: object) -> str:
    """``aten.add.Tensor`` for OpOverloads, the qualified name for Python callables."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__qualname__", None) or str(target)
