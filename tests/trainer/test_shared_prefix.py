"""train.shared_prefix (mtrain/trainer/prefix_tree.py, mtrain/models/tree_attention.py): a group's prompt computed
once per micro-batch gives the logprobs and the gradients of the unshared packed computation, checked in float64
through the real Megatron model; the stream layout and the planner on their own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.trainer.packing import make_pack, pack, unpack
from mtrain.trainer.prefix_tree import make_tree_pack, plan_shared_micro_batches, shared_length

REPO = Path(__file__).resolve().parents[2]


def _rows(groups, vocab=97, seed=0):
    """Token rows of GRPO-like groups: (prompt length, [response lengths]) each; the same prompt within a group."""
    g = torch.Generator().manual_seed(seed)
    rows, keys = [], []
    for k, (p, resp) in enumerate(groups):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        for r in resp:
            rows.append(prompt + torch.randint(3, vocab, (r,), generator=g).tolist())
            keys.append(k)
    return rows, keys


def test_layout_positions_and_field_round_trip():
    rows, keys = _rows([(6, [3, 1, 4]), (5, [2]), (4, [2, 2])])
    pk = make_tree_pack(list(range(len(rows))), rows, keys, pad_to_multiple=8)
    # group 0 shares 5 tokens (the 6th, the last prompt token, stays in every sample), group 2 shares 3
    assert pk.shared.tolist() == [5, 5, 5, 0, 3, 3]
    assert pk.total % 8 == 0 and pk.shared_tokens == 5 * 2 + 3
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    stream = pack(pk, tokens, width, "tokens")
    pos = pk.position_ids()[0]
    for i, r in enumerate(rows):  # every token of every row is found at its own position in the stream
        _, col, dst = pk.row_positions(width, 0, writing=False)
        mine = dst[_ == i]
        assert stream[mine].tolist() == r and pos[mine].tolist() == list(range(len(r)))
    back = unpack(pk, stream.float(), width, width)
    assert torch.equal(back.long(), tokens)
    # a per-predicting-position field: each row's own values, also where the stream shares them
    x = torch.randn(len(rows), width - 1)
    for i, r in enumerate(rows):
        x[i, len(r) - 1:] = 0
        x[i, :shared_length([rows[j] for j in range(len(rows)) if keys[j] == keys[i]])] = 7.0  # prefix: equal
    assert torch.equal(unpack(pk, pack(pk, x, width, "f"), width - 1, width), x)


def test_planner_keeps_a_group_together_and_splits_only_when_too_big():
    rows, keys = _rows([(30, [5, 6, 7, 8]), (20, [4, 4]), (10, [3])])
    plan = plan_shared_micro_batches(rows, keys, budget=70)
    where = {i: b for b, mb in enumerate(plan) for i in mb}
    assert len({where[i] for i in range(4)}) == 1 and len({where[i] for i in (4, 5)}) == 1
    assert sorted(i for mb in plan for i in mb) == list(range(len(rows)))
    for mb in plan:
        assert make_tree_pack(mb, [rows[i] for i in mb], [keys[i] for i in mb]).total <= 70
    tight = plan_shared_micro_batches(rows, keys, budget=45)  # group 0 (29 shared + 30 own tokens) must split
    assert len({b for b, mb in enumerate(tight) for i in mb if i < 4}) >= 2
    for mb in tight:
        assert make_tree_pack(mb, [rows[i] for i in mb], [keys[i] for i in mb]).total <= 45


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_logprobs_and_gradients_equal_the_unshared_computation_in_float64(rope):
    proc = subprocess.run([sys.executable, __file__, "model", rope], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0 and "model ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-4000:]


def _model_check(rope: str) -> None:
    import socket
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.trainer.learner.actor import Actor, token_logprobs
    init_distributed(seed=0)
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
              rope_theta=10000.0, attention_bias=False, mlp_bias=False, attention_dropout=0.0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.02, max_position_embeddings=4096, hidden_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=97, tie_word_embeddings=False)
    if rope == "yarn":  # rope_scaling yarn (Qwen's long-context recipe): the prompts run past its 16 original positions
        hf.update(max_position_embeddings=64,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))
    cfg = load_config(REPO / "mtrain/configs/tiny_llama_grpo.yaml",
                      ["model.hf_path=unused", "train.max_tokens_per_micro_batch=512", "train.shared_prefix=true",
                       "algo.kl_coef=0"])
    actor = Actor(cfg, hf, trainable=False)
    assert actor.rope_per_token
    model = actor.chunks[0].double()
    for p in model.parameters():
        p.requires_grad_(True)
    rows, keys = _rows([(40, [7, 12, 3, 9]), (25, [5]), (33, [11, 2, 6])], vocab=97, seed=1)
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    weights = torch.randn(len(rows), width - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    valid = torch.arange(width - 1)[None, :] < torch.tensor([len(r) - 1 for r in rows])[:, None]
    prompt = torch.tensor([40] * 4 + [25] + [33] * 3)
    response = torch.arange(width - 1)[None, :] >= (prompt[:, None] - 1)  # positions predicting response tokens

    def run(pk):
        stream = pack(pk, tokens, width, "tokens").unsqueeze(0)
        pos = pk.position_ids()
        params = pk.packed_seq_params("cpu", True, pos)
        model.zero_grad(set_to_none=True)
        logits = model(stream, pos, None, packed_seq_params=params)
        lp = unpack(pk, token_logprobs(logits, stream, 97, 1.0)[0], width - 1, width)
        torch.where(valid & response, lp * weights, torch.zeros((), dtype=lp.dtype)).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    idx = list(range(len(rows)))
    lp_ref, g_ref = run(make_pack(idx, [len(r) for r in rows]))
    tree = make_tree_pack(idx, rows, keys)
    assert tree.shared_tokens == 39 * 3 + 32 * 2
    lp_tree, g_tree = run(tree)
    d = (lp_tree - lp_ref).abs()[valid & response].max()
    assert d < 1e-12, d
    assert (lp_tree - lp_ref).abs()[valid].max() < 1e-12  # the prompt positions too
    worst = max(float((g_tree[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp(min=1e-30)) for n in g_ref)
    assert worst < 1e-10, worst
    print("model ok", float(d), worst)


if __name__ == "__main__" and sys.argv[1:2] == ["model"]:
    _model_check(sys.argv[2])
