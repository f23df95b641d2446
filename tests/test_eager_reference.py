"""The eager reference is settled for every function torch hands to oneMKL's vector math."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.eager_reference import VECTOR_MATH_OPS

VML_HEADER = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cpu", "vml.h")


@pytest.mark.skipif(not os.path.exists(VML_HEADER), reason="this torch ships without ATen's headers")
def test_every_vector_math_function_of_this_torch_is_settled():
    with open(VML_HEADER) as header:
        routed = set(re.findall(r"^\s*IMPLEMENT_VML_MKL\((\w+),", header.read(), flags=re.MULTILINE))
    assert routed, f"no IMPLEMENT_VML_MKL lines in {VML_HEADER}: the header's layout changed"
    assert routed <= {op.__name__ for op in VECTOR_MATH_OPS}
