"""Backend options: one frozen dataclass built from ``torch.compile(options=...)`` and ``TPUCOMPILE_*``.

Options given to ``torch.compile`` win over environment variables, which win over the defaults. An unknown
option is refused with the list of valid ones, so a typo never silently compiles with defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from tpucompile.errors import OptionsError

ENV_PREFIX = "TPUCOMPILE_"


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything that changes how a graph is compiled or run."""

    platform: str | None = None
    """PJRT platform to compile for and run on ("cpu", "cuda", "tpu"); None takes jax's default backend."""

    embed_constant_limit: int = 1024
    """Tensor constants with at most this many elements are embedded in the program; larger ones are passed
    as runtime arguments so they do not bloat the program text or its cache key."""

    executable_cache_size: int = 256
    """How many loaded executables the in-process cache keeps (least recently used are dropped)."""

    max_shape_specializations: int = 64
    """How many concrete-shape executables one symbolic graph keeps before the least recently used is
    dropped (each extra shape is a recompile, logged with its reason)."""

    verify: bool = True
    """Run the MLIR verifier on every lowered module before compiling it."""

    fallback: str = "eager"
    """What to do with an op or dtype tpucompile cannot lower: "eager" runs it in PyTorch between compiled
    regions (with one warning per op), "error" raises ``UnsupportedOpError``."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Options:
        """Combine defaults, ``TPUCOMPILE_<NAME>`` environment variables and explicit options."""
        environ = os.environ if environ is None else environ
        valid = cls.field_names()
        values: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in valid:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw:
                values[name] = _parse_env(name, raw, fields[name].type)
        for name, value in (options or {}).items():
            if name not in fields:
                raise OptionsError(
                    f"unknown tpucompile option {name!r}; valid options are: {', '.join(sorted(valid))}"
                )
            values[name] = _check_type(name, value, fields[name].type)
        return cls(**values)


_CHOICES = {"fallback": ("eager", "error")}


def _check_type(name: str, value: Any, annotation: str) -> Any:
    if name in _CHOICES and value not in _CHOICES[name]:
        raise OptionsError(f"tpucompile option {name!r} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
    if annotation == "bool" and not isinstance(value, bool):
        raise OptionsError(f"tpucompile option {name!r} must be a bool, got {value!r}")
    if annotation == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise OptionsError(f"tpucompile option {name!r} must be a non-negative int, got {value!r}")
    if annotation == "str | None" and value is not None and not isinstance(value, str):
        raise OptionsError(f"tpucompile option {name!r} must be a string, got {value!r}")
    return value


def _parse_env(name: str, raw: str, annotation: str) -> Any:
    var = ENV_PREFIX + name.upper()
    if annotation == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise OptionsError(f"{var}={raw!r} is not a boolean (use 1/0, true/false)")
    if annotation == "int":
        try:
            return _check_type(name, int(raw), annotation)
        except ValueError:
            raise OptionsError(f"{var}={raw!r} is not an integer") from None
    return _check_type(name, raw, annotation)
