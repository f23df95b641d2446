"""How a forward hands the values it saves to its backward when both run on buckets.

A bucketed program's results are padded to its bucket, and the runtime cuts each to its actual size (a copy)
before torch sees it; the backward's bucketed program pads its arguments again (another copy). A value only
the backward reads (AOTAutograd saves it between the two graphs) need not be cut at all: the backward's
program marks each argument with its actual sizes and ignores the padding. That holds only when the backward
is bucketed too and reads every size from an argument that is never padded (a size, a gradient, an input):
a per-size backward would take the bucket's sizes for the actual ones. The forward is compiled first, and
AOTAutograd compiles the backward at the first backward call, so the two graphs share one ``SavedHandoff``:
the backward's bucketed graph says when it takes padded values, and the forward keeps them padded from then
on.

Both AOTAutograd graphs of a Dynamo graph carry a ``HandoffEnd`` in ``GraphModule.meta[SAVED_HANDOFF]``.
"""

from __future__ import annotations

import dataclasses

SAVED_HANDOFF = "tpucompile_saved_handoff"
"""The ``GraphModule.meta`` key of a forward's or backward's ``HandoffEnd``."""


@dataclasses.dataclass
class SavedHandoff:
    """What the forward and the backward of one Dynamo graph agree on."""

    returns: int | None = None
    """How many of the forward's outputs go to the caller; those after them are saved for the backward."""
    backward_takes_padded: bool = False
    """Set by the backward's bucketed graph: its saved values may arrive padded to the bucket."""


@dataclasses.dataclass(frozen=True)
class HandoffEnd:
    """One graph's side of a ``SavedHandoff``: ``role`` is "forward" or "backward"."""

    role: str
    handoff: SavedHandoff


def is_saved_activation(placeholder_name: str) -> bool:
    """Whether a backward graph's placeholder is a value its forward computed and saved: AOTAutograd names
    the forward's inputs ``primals_*`` and the output gradients ``tangents_*``, and saved values after the
    forward nodes they were."""
    return not placeholder_name.startswith(("primals_", "tangents_"))
