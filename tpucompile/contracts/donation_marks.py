"""How a graph says which of its arguments its program may take over (donate), read by the lowering.

A program that donates an argument may write one of its results into that argument's memory (XLA's
input/output aliasing), so the result costs no new allocation and the argument is gone after the call. Only
two kinds of argument qualify, each marked on its placeholder's ``meta`` under ``DONATABLE``:

- ``SAVED``: a value the forward computed and saved for the backward, which nothing but this backward reads
  (AOTAutograd's donated buffers: not an input or output of the forward, nor a gradient);
- an int ``i``: an argument whose new value is the graph's output ``i`` (an in-place update, such as an
  optimiser's step or BatchNorm's running statistics), so its memory may hold the new value.

Which kinds a program actually donates depends on who owns the arguments at run time (``donated_kinds``).
"""

from __future__ import annotations

DONATABLE = "tpucompile_donatable"
"""The placeholder ``meta`` key holding the argument's donation kind."""

SAVED = "saved"
"""The kind of a backward's saved forward value."""

UPDATED = "updated"
"""The name of the kind of in-place updated arguments (whose mark is the index of the new value's output)."""

SAVED_ON_DEVICE = "tpucompile_saved_on_device"
"""A backward graph's ``meta`` key: its saved values reach it as buffers the runtime owns (not torch tensors)."""


def kind_of(mark: object) -> str | None:
    """The kind of a placeholder's donation mark (``SAVED`` or ``UPDATED``), None when it has none."""
    if mark == SAVED:
        return SAVED
    if isinstance(mark, int) and not isinstance(mark, bool) and mark >= 0:
        return UPDATED
    return None


def donated_kinds(enabled: bool, compile_only: bool, platform: str, devices: int, saved_on_device: bool
                  ) -> frozenset[str]:
    """The kinds of marked arguments a program donates.

    A program compiled for a target it never runs on here donates every marked argument, as a runtime on that
    target hands it buffers it owns. A program run here donates nothing on several devices (sharded arguments
    are placed per call), and on the CPU, where arguments are torch's own memory imported without a copy,
    donates only saved values the runtime keeps as its own buffers; elsewhere arguments are copied to the device
    on the way in, so the copy is the program's to take.
    """
    if not enabled or (devices > 1 and not compile_only):
        return frozenset()
    if compile_only or platform != "cpu":
        return frozenset({SAVED, UPDATED})
    return frozenset({SAVED}) if saved_on_device else frozenset()
