"""Test-wide settings for the 2-core CPU box.

Megatron's fused ops are torch.compile'd: a cold compile costs 8-24 s here, so dynamo is off.
One OpenMP thread per process: multi-rank tests run several gloo ranks on two cores.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long test, left out of the default run; run with MTRAIN_SLOW=1")


def pytest_collection_modifyitems(config, items):
    """Slow tests run only with MTRAIN_SLOW=1: the default run (CI) stays representative and short."""
    if os.environ.get("MTRAIN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set MTRAIN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
