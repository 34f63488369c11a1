"""Compiled Triton on a real GPU against the torch executor (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from compiled_script import run_compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_equals_torch_on_random_tables():
    run_compiled("cuda_random_tables.py", "all cases equal")
