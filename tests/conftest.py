import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, so recompile limits never turn a test into eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
