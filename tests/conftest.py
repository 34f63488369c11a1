"""Test-wide settings for the 2-core CPU box.

Megatron's fused ops are torch.compile'd: a cold compile costs 8-24 s here, so dynamo is off.
One OpenMP thread per process: multi-rank tests run several gloo ranks on two cores.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
