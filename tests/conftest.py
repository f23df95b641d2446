import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Tests are strict: an op without a lowering fails instead of quietly running in eager PyTorch. The tests of
# the eager fallback itself ask for it explicitly.
os.environ["TPUCOMPILE_FALLBACK"] = "error"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, so recompile limits never turn a test into eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
