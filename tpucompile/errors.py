"""The exceptions a user can see. Each message names what is wrong and where in the user's code."""

from __future__ import annotations


class TpuCompileError(Exception):
    """Base class of every error tpucompile raises on purpose."""


class OptionsError(TpuCompileError, ValueError):
    """An option passed to ``torch.compile(..., options=...)`` or the environment is invalid."""


class ShardingError(OptionsError):
    """A mesh or sharding plan cannot lay the graph over the devices (raised before anything is compiled)."""


class UnsupportedOpError(TpuCompileError, NotImplementedError):
    """The graph holds an ATen op, dtype or argument that tpucompile cannot lower."""


class LoweringError(TpuCompileError):
    """A lowering rule failed on a node it claims to support (a bug in tpucompile)."""


class CompileError(TpuCompileError):
    """XLA refused a module that tpucompile built."""


class TpuCompileWarning(UserWarning):
    """Something was compiled differently than asked, e.g. an op ran in eager PyTorch."""


class CacheMissError(TpuCompileError):
    """``cache_mode="strict"`` and a graph's executable was not in the cache: it would have been compiled."""
