"""Per-token RoPE for packed streams (mtrain/models/packed_rope.py) equals megatron-core's THD RoPE, and the packed
trainer step's host-sync ops per micro-batch do not grow with layers or sequences (issue 18)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("kind", ["plain", "interleaved", "yarn"])
def test_per_token_rope_equals_megatron_thd_in_float64(kind):
    # in a fresh interpreter: on a CPU build megatron's RotaryEmbedding needs mtrain's CPU shim, which this process
    # should not keep for the tests after it
    proc = subprocess.run([sys.executable, __file__, "rope", kind], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert proc.returncode == 0 and "rope ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def _rope_check(kind: str) -> None:
    from mtrain.compat import cpu_shim
    if not torch.cuda.is_available():
        cpu_shim.apply()  # megatron-core builds its inverse frequencies on torch.cuda.current_device()
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from mtrain.models.packed_rope import PerTokenRotaryEmbedding, PerTokenYarnRotaryEmbedding
    from mtrain.trainer.packing import make_pack

    lengths = [5, 1, 17, 9, 3]
    pk = make_pack(list(range(len(lengths))), lengths, min_total=40, pad_to_multiple=8)  # with a padding segment
    interleaved = kind == "interleaved"
    if kind == "yarn":  # megatron returns YaRN's cos/sin scale beside its table; the attention applies it
        rope = YarnRotaryEmbedding(kv_channels=16, rotary_base=10000, scaling_factor=4.0,
                                   original_max_position_embeddings=8)
        cls, table = PerTokenYarnRotaryEmbedding, lambda r: r(pk.max_seqlen, packed_seq=True)
    else:
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved, rotary_base=10000)
        cls, table = PerTokenRotaryEmbedding, lambda r: (r(pk.max_seqlen, packed_seq=True), 1.0)
    freqs, mscale = table(rope)  # [max_seqlen, 1, 1, 16]
    assert (mscale != 1.0) == (kind == "yarn")
    g = torch.Generator().manual_seed(0)
    t = torch.randn(pk.total, 4, 16, generator=g, dtype=torch.float64)
    ref = _apply_rotary_pos_emb_thd(t, pk.cu_seqlens, freqs.double(), rotary_interleaved=interleaved, mscale=mscale,
                                    cp_group=_OneRank())

    params = pk.packed_seq_params("cpu", host_cu_seqlens=True, rope_positions=pk.position_ids())
    per_token = cls.__new__(cls)
    per_token.__dict__.update(rope.__dict__)
    assert per_token.get_rotary_seq_len(None, None, None, None, params) == pk.max_seqlen
    f_tok, m_tok = table(per_token)
    assert f_tok.shape == (pk.total, 1, 1, 16) and m_tok == mscale
    assert params.cu_seqlens_q.tolist() == [0, pk.total]  # what megatron-core's RoPE sees: one segment
    out = _apply_rotary_pos_emb_thd(t, params.cu_seqlens_q, f_tok.double(), rotary_interleaved=interleaved,
                                    mscale=m_tok, cp_group=_OneRank())
    assert torch.equal(out, ref)
    # the attention still reads the real boundaries
    assert params.mtrain_host_cu_seqlens == pk.cu_seqlens.tolist()
    # without positions (padded micro-batches, or no stash) it is the parent's table
    assert torch.equal(table(per_token)[0], table(rope)[0])
    print("rope ok")


def test_host_sync_ops_per_micro_batch_do_not_grow_with_layers_or_sequences(tmp_path):
    """benchmarks/bench_packed_host_ops.py at 2 and 4 layers, 4 and 8 sequences per micro-batch: the packed
    path's device-sync ops (beyond the padded path's) and its aten ops per layer do not grow with the number of
    sequences."""
    import json
    out = tmp_path / "ops.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_packed_host_ops.py"), "--budget", "128",
                           "--lens", "32", "16", "--layers", "1", "2", "--micro", "1", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    # Outside the model's passes: the optimizer step (megatron's local multi-tensor L2 norm reads every parameter's
    # norm; the same in both modes, growing with parameters), the step metrics, and host tensors (HOST_TENSOR_SITES:
    # the packing before the schedule, megatron's THD RoPE reading the host cu_seqlens).
    outside = ("mtrain/trainer/packing.py", "rope_utils.py", "megatron/core/optimizer/", "local_multi_tensor_l2_norm",
               "actor.py", "clip_grads.py")

    def in_model(key):
        return sum(c for k, c in runs[key]["sync_sites"].items() if not any(o in k for o in outside))
    packed = {k: in_model(k) for k in runs if k.endswith("/packed")}
    padded = {k: in_model(k) for k in runs if k.endswith("/padded")}
    # the same at 1 and 2 layers, 4 and 8 sequences: the step's one scalar outside any named site (the sampled
    # token's logprob, mtrain/models/token_logprobs.py, reads no scalar on the host; megatron's vocab-parallel cross
    # entropy, which it replaced, read 2 per forward)
    assert set(packed.values()) == {1}, (packed, runs["2/16/packed"]["sync_sites"])
    assert all(packed[k.replace("padded", "packed")] <= padded[k] for k in padded), (packed, padded)
    # aten ops of the packed step: no term in layers x sequences (megatron's THD RoPE split / slice / cat per
    # sequence in every layer, before mtrain/models/packed_rope.py)
    a = {k: runs[k]["all"] for k in runs if k.endswith("/packed")}
    growth = (a["2/16/packed"] - a["1/16/packed"]) - (a["2/32/packed"] - a["1/32/packed"])
    assert abs(growth) <= 2, a


if __name__ == "__main__" and sys.argv[1:2] == ["rope"]:
    _rope_check(sys.argv[2])
