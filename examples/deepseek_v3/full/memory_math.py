"""Per-GPU memory of DeepSeek-V3 RL training + colocated SGLang, from config.json alone (an estimate).

    python examples/deepseek_v3/full/memory_math.py [--nodes 64] [--pp 16] [--ep 32] [--engine-tp 16]
        [--seq 16384] [--gpu-gb 141] [--cpu-offload]

Counts parameters from the architecture (the same formulas as tests/reshard/test_simulate.py), places them
on the training ranks (TP1, uneven PP first 3 / last 2, EP over the data-parallel ranks) and on the engine
ranks, and prints the arithmetic the README quotes. Nothing here has been measured.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GB = 1e9


def counts(c: dict) -> dict:
    H, heads = c["hidden_size"], c["num_attention_heads"]
    ql, kl, nope, rope, vd = (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"])
    E, Im = c["n_routed_experts"], c["moe_intermediate_size"]
    attn = 2 * H + ql * H + ql + heads * (nope + rope) * ql + (kl + rope) * H + kl + heads * (nope + vd) * kl + H * heads * vd
    return dict(attn=attn, attn_replicated=2 * H + (ql + kl + rope) * H + ql + kl, dense_mlp=3 * H * c["intermediate_size"],
                expert=3 * H * Im, experts=E, shared=c["n_shared_experts"] * 3 * H * Im, router=E * H + E,
                embed=c["vocab_size"] * H, mtp_extra=2 * H + 2 * H * H + H)


def stages(layers: int, pp: int, first: int, last: int) -> list[list[int]]:
    per = (layers - first - last) // (pp - 2)
    sizes = [first] + [per] * (pp - 2) + [last]
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def training(c: dict, k: dict, nodes: int, pp: int, ep: int, seq: int, mtp: bool) -> list[dict]:
    """Per pipeline stage: parameters on one GPU and the bytes of each kind of state."""
    world = nodes * 8
    dp = world // pp  # TP1, CP1
    edp = dp // ep  # expert data parallel: how many GPUs share (and shard the optimizer of) one expert
    dense_k = c["first_k_dense_replace"]
    out = []
    plan = stages(c["num_hidden_layers"], pp, 3, 2)
    for s, layers in enumerate(plan):
        dense = sum(k["attn"] + (k["dense_mlp"] if i < dense_k else k["shared"] + k["router"]) for i in layers)
        expert = sum(k["experts"] // ep * k["expert"] for i in layers if i >= dense_k)
        if s == 0:
            dense += k["embed"]
        if s == pp - 1:
            dense += k["embed"] + c["hidden_size"]  # lm_head, final norm
            if mtp:
                dense += k["attn"] + k["shared"] + k["router"] + k["mtp_extra"]
                expert += k["experts"] // ep * k["expert"]
        n = dense + expert
        in_flight = pp - s  # 1F1B: stage s holds pp - s microbatches' checkpoints at its peak
        act_ckpt = in_flight * len(layers) * seq * c["hidden_size"] * 2  # full recompute: each layer's input
        # Recomputing one layer: MLA q/k/v/out per head (bf16) and MoE dispatch (top-k copies of each token
        # through fc1/act/fc2), doubled for backward.
        per_token = 2 * (c["num_attention_heads"] * (2 * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
                                                     + 2 * c["v_head_dim"])
                         + c["num_experts_per_tok"] * (2 * c["hidden_size"] + 3 * c["moe_intermediate_size"]))
        work = 2 * seq * per_token
        if s == pp - 1:
            work += 2 * seq * c["vocab_size"] * 4  # float32 logits and their gradient
        out.append(dict(stage=s, layers=len(layers), params=n, dense=dense, expert=expert, dp=dp, edp=edp,
                        weights=2 * n, grads=4 * n, optim=12 * dense / dp + 12 * expert / edp,
                        act=act_ckpt + work))
    return out


def engine(c: dict, k: dict, tp: int) -> dict:
    """SGLang engine of `tp` ranks (EP = tp): bf16 weights per GPU and the MLA latent cache per token."""
    layers, dense_k = c["num_hidden_layers"], c["first_k_dense_replace"]
    replicated = c["hidden_size"] + layers * k["attn_replicated"] + (layers - dense_k) * k["router"]
    total = 2 * k["embed"] + c["hidden_size"] + layers * k["attn"] + dense_k * k["dense_mlp"] + \
        (layers - dense_k) * (k["shared"] + k["router"] + k["experts"] * k["expert"])
    per_gpu = replicated + (total - replicated) / tp
    kv_per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * layers * 2  # every TP rank holds the latent
    return dict(tp=tp, total=total, per_gpu_bytes=2 * per_gpu, kv_per_token=kv_per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--engine-tp", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16384, help="tokens per micro-batch (packed)")
    ap.add_argument("--gpu-gb", type=float, default=141.0)
    ap.add_argument("--cpu-offload", action="store_true", help="optimizer state (fp32 master, m, v) on the host")
    ap.add_argument("--mtp", action="store_true", help="train the MTP layer too (off in RL, as in verl)")
    ap.add_argument("--overhead-gb", type=float, default=6.0, help="CUDA context, NCCL buffers, fragmentation")
    a = ap.parse_args()
    c = json.loads((Path(__file__).parent / "config.json").read_text())
    k = counts(c)
    rows = training(c, k, a.nodes, a.pp, a.ep, a.seq, a.mtp)
    e = engine(c, k, a.engine_tp)
    print(f"{a.nodes} nodes x 8 GPUs, TP1 PP{a.pp} (3 | {rows[1]['layers']} ... | 2 layers) EP{a.ep}, "
          f"DP {rows[0]['dp']}, expert DP {rows[0]['edp']}; micro-batch {a.seq} tokens; GPU {a.gpu_gb} GB")
    print(" stage params(B) weights grads optim(sharded) act(recompute) | train peak | gen: train w + engine w + KV")
    free_kv = []
    for r in rows:
        optim = 0.0 if a.cpu_offload else r["optim"]
        train_peak = r["weights"] + r["grads"] + optim + r["act"] + a.overhead_gb * GB
        # While the engine generates, grads and optimizer state are on the host (engine.offload_train) and
        # activations are gone; the training weights stay.
        kv = a.gpu_gb * GB - r["weights"] - e["per_gpu_bytes"] - a.overhead_gb * GB
        free_kv.append(kv)
        print(f" {r['stage']:5d} {r['params'] / 1e9:9.2f} {r['weights'] / GB:7.1f} {r['grads'] / GB:5.1f} "
              f"{optim / GB:14.1f} {r['act'] / GB:14.1f} | {train_peak / GB:10.1f} | "
              f"{r['weights'] / GB:.1f} + {e['per_gpu_bytes'] / GB:.1f} + {kv / GB:.1f}")
    kv = min(free_kv)
    tokens = kv / e["kv_per_token"]
    print(f"engine TP{e['tp']} x EP{e['tp']}: {e['total'] / 1e9:.1f}B params, {e['per_gpu_bytes'] / GB:.1f} GB bf16 per GPU;"
          f" MLA latent {e['kv_per_token']} B/token ({c['kv_lora_rank']}+{c['qk_rope_head_dim']}) x "
          f"{c['num_hidden_layers']} x 2; worst-stage KV room {kv / GB:.1f} GB = {tokens / 1e3:.0f}k tokens per engine")


if __name__ == "__main__":
    main()
