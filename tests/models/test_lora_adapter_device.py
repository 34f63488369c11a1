"""The fused-slice permutation lives where the adapters do: they are attached after the model moved to its device,
so nothing moves the buffer later (on the H200 the first LoRA forward died in index_select with the index on CPU)."""
from __future__ import annotations

import torch

from mtrain.models.lora import LoraAdapter


def test_permutation_is_on_the_adapters_device():
    slices = [(name, torch.empty(4, 8, device="meta"), torch.empty(6, 4, device="meta")) for name in ("q", "k")]
    adapter = LoraAdapter(slices, perm=[6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5], scaling=2.0, dropout=0.0,
                          row_parallel=False, tp_group=None, sequence_parallel=False, norm=None)
    assert adapter.perm.device.type == "meta"
    assert adapter.perm.dtype == torch.int64 and adapter.perm.shape == (12,)
