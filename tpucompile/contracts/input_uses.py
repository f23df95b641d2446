"""The uses step reports count memory by: what each input of a compiled graph holds. A leaf module (no torch),
shared by the frontend that notes each input's use and the reports that read it."""

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, INPUTS = "parameters", "gradients", "optimizer_state", "inputs"
ACTIVATIONS = "activations"
"""A backward's inputs that its forward computed (saved for it)."""
RETURNED_GRADIENTS = "gradients_returned"
"""Not an input: the gradients a backward returns."""
USES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, INPUTS)
USES_KEY = "tpucompile_input_uses"
"""The ``meta`` key of an ATen graph holding the use of each of its inputs (by AOTAutograd's order)."""
BUDGET_KEY = "tpucompile_activation_budget"
"""The ``meta`` key of a training graph's forward and backward holding how the activation budget it was
partitioned with was chosen (``frontend.activation_budget.BudgetChoice.as_dict``)."""
