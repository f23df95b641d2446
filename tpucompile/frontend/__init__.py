"""Rewrites of the torch-level graph Dynamo captures, before AOTAutograd traces it into ATen, and the
decomposition table AOTAutograd traces with.

Anything that must see a torch-level call whole (``scaled_dot_product_attention``, ``interpolate``) is
rewritten here, and the arguments of AOTAutograd's graphs their programs may take over are marked
(``donation``); graphs of meta tensors trace as real ones would (``meta_tracing``), and each input's use is
noted (``graph_input_uses``). Passes over the ATen graphs live in ``tpucompile.passes``.
"""

from tpucompile.frontend.activation_budget import (
    BUDGET_KEY,
    FIRST_TRIAL,
    LoopBodyTrial,
    fit_loop_bodies,
    fitting_partition,
    traced_budget,
)
from tpucompile.frontend.attention import rewrite_attention
from tpucompile.frontend.decompositions import decomposition_table
from tpucompile.frontend.donation import mark_donatable
from tpucompile.frontend.graph_input_uses import USES_KEY, graph_input_uses
from tpucompile.frontend.interpolation import rewrite_interpolation
from tpucompile.frontend.layer_rolling import ROLLING_KEY, roll_repeated_layers
from tpucompile.frontend.meta_tracing import traced_like_real_tensors
from tpucompile.frontend.parameter_stacks import take_out_parameter_stacks

__all__ = [
    "BUDGET_KEY",
    "FIRST_TRIAL",
    "ROLLING_KEY",
    "USES_KEY",
    "LoopBodyTrial",
    "decomposition_table",
    "fit_loop_bodies",
    "fitting_partition",
    "graph_input_uses",
    "mark_donatable",
    "rewrite_attention",
    "rewrite_interpolation",
    "roll_repeated_layers",
    "take_out_parameter_stacks",
    "traced_budget",
    "traced_like_real_tensors",
]
