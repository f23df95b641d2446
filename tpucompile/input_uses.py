"""The uses step reports count memory by: what each input of a compiled graph holds. A leaf module (no torch),
shared by the frontend that notes each input's use and the reports that read it."""

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, INPUTS = "parameters", "gradients", "optimizer_state", "inputs"
ACTIVATIONS = "activations"
"""A backward's inputs that its forward computed (saved for it)."""
RETURNED_GRADIENTS = "gradients_returned"
"""Not an input: the gradients a backward returns."""
USES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, INPUTS)
KINDS_KEY = "tpucompile_input_kinds"
"""The ``meta`` key of an ATen graph holding the use of each of its inputs (by AOTAutograd's order)."""
