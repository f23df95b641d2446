"""Rewrites of the torch-level graph Dynamo captures, before AOTAutograd traces it into ATen, and the
decomposition table AOTAutograd traces with.

Anything that must see a torch-level call whole (``scaled_dot_product_attention``, ``interpolate``) is
rewritten here; passes over the ATen graphs live in ``tpucompile.passes``.
"""

from tpucompile.frontend.attention import rewrite_attention
from tpucompile.frontend.decompositions import decomposition_table
from tpucompile.frontend.interpolation import rewrite_interpolation

__all__ = ["decomposition_table", "rewrite_attention", "rewrite_interpolation"]
