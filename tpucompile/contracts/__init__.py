"""Contracts several layers share: the names, marks and conventions one layer writes and another reads.

Each module here is plain Python over torch (or sympy), imports nothing else of the package, and so may be
imported from anywhere: how a graph marks the arguments its program may take over (``donation_marks``), the
uses step reports count memory by (``input_uses``), the ``tpucompile::attention`` op pair the frontend routes
to and a lowering rule lowers (``attention_ops``), PyTorch's resize geometry (``resize_scale``), how a
program's arguments and results map to a graph's (``calling_convention``), size symbols' values for a call
(``size_expressions``), whether a bucketed forward hands its saved values over padded (``saved_handoff``),
and compile target names (``target_names``).
"""
