"""Per-GPU memory of DeepSeek-V3 RL training + colocated SGLang, from config.json alone (an estimate).

    python examples/deepseek_v3/full/memory_math.py [--nodes 64] [--pp 16] [--ep 32] [--engine-tp 16]
        [--seq 16384] [--gpu-gb 141] [--cpu-offload] [--engine-fp8]
    # the scaled-down run (examples/deepseek_v3/small), compared with what it measured:
    python examples/deepseek_v3/full/memory_math.py --config runs/dsv3_small/config.json --nodes 1 \
        --gpus-per-node 4 --pp 2 --ep 2 --first-stage-layers 3 --last-stage-layers 4 --dtype fp32 \
        --measured runs/dsv3_small/run/metrics.jsonl

Counts parameters from the architecture (the same formulas as tests/reshard/test_simulate.py), places them
on the training ranks (TP1, uneven PP, EP over the data-parallel ranks) and on the engine ranks, and prints
the arithmetic the README quotes. `--measured` reads the `mem/stage{s}/*` metrics a run logged
(mtrain/trainer/memory_stats.py: parameters, DDP gradient buffers, optimizer state, per pipeline stage) and
prints them beside the prediction of the same formulas.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GB = 1e9


def padded_vocab(c: dict, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 (x TP): its embedding and head have these rows."""
    return -(-c["vocab_size"] // multiple) * multiple


def counts(c: dict) -> dict:
    H, heads = c["hidden_size"], c["num_attention_heads"]
    ql, kl, nope, rope, vd = (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"])
    E, Im = c["n_routed_experts"], c["moe_intermediate_size"]
    attn = 2 * H + ql * H + ql + heads * (nope + rope) * ql + (kl + rope) * H + kl + heads * (nope + vd) * kl + H * heads * vd
    return dict(attn=attn, attn_replicated=2 * H + (ql + kl + rope) * H + ql + kl, dense_mlp=3 * H * c["intermediate_size"],
                expert=3 * H * Im, experts=E, shared=c["n_shared_experts"] * 3 * H * Im, router=E * H + E,
                embed=padded_vocab(c) * H, mtp_extra=2 * H + 2 * H * H + H)


def stages(layers: int, pp: int, first: int | None, last: int | None) -> list[list[int]]:
    """Layer indices per stage, by the planner's own rule (mtrain.reshard.placement.MegatronLayout)."""
    from mtrain.reshard.placement import MegatronLayout
    sizes = MegatronLayout(pp=pp, first_stage_layers=first, last_stage_layers=last).stage_layers(layers)
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


# bytes per parameter: (weights, main_grad, optimizer state). bf16: fp32 master + Adam m, v; fp32: the
# parameters are their own master copy, Adam m, v only. Gradients accumulate in fp32 (grad_reduce_in_fp32).
BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}


def training(c: dict, k: dict, nodes: int, pp: int, ep: int, seq: int, mtp: bool, gpus_per_node: int = 8,
             first: int | None = 3, last: int | None = 2, dtype: str = "bf16") -> list[dict]:
    """Per pipeline stage: parameters on one GPU and the bytes of each kind of state."""
    world = nodes * gpus_per_node
    dp = world // pp  # TP1, CP1
    edp = dp // ep  # expert data parallel: how many GPUs share (and shard the optimizer of) one expert
    dense_k = c["first_k_dense_replace"]
    wb, gb, ob = BYTES[dtype]
    out = []
    plan = stages(c["num_hidden_layers"], pp, first, last)
    for s, layers in enumerate(plan):
        dense = sum(k["attn"] + (k["dense_mlp"] if i < dense_k else k["shared"] + k["router"]) for i in layers)
        expert = sum(k["experts"] // ep * k["expert"] for i in layers if i >= dense_k)
        if s == 0:
            dense += k["embed"]
        if s == pp - 1:
            dense += k["embed"] + c["hidden_size"]  # lm_head, final norm
            if mtp:  # the MTP layer (an MoE layer) and Megatron's copy of the embedding on the last stage
                dense += k["attn"] + k["shared"] + k["router"] + k["mtp_extra"] + (k["embed"] if pp > 1 else 0)
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
                        weights=wb * n, grads=gb * n, optim=ob * dense / dp + ob * expert / edp,
                        act=act_ckpt + work))
    return out


def engine(c: dict, k: dict, tp: int, fp8: bool = False) -> dict:
    """SGLang engine of `tp` ranks (EP = tp): weights per GPU and the MLA latent cache per token.

    fp8: the release format in the engine: linear projections 1 byte per parameter plus one float32 scale per
    128x128 block; embedding, head, norms and router stay bf16."""
    layers, dense_k = c["num_hidden_layers"], c["first_k_dense_replace"]
    H = c["hidden_size"]
    replicated = H + layers * k["attn_replicated"] + (layers - dense_k) * k["router"]
    total = 2 * k["embed"] + H + layers * k["attn"] + dense_k * k["dense_mlp"] + \
        (layers - dense_k) * (k["shared"] + k["router"] + k["experts"] * k["expert"])
    # bf16-only part: embedding + head (split by TP), norms + router (replicated, small)
    norms = H + layers * (2 * H + c["q_lora_rank"] + c["kv_lora_rank"])
    plain_repl = norms + (layers - dense_k) * k["router"]
    plain_split = 2 * k["embed"]
    if fp8:
        b = (c.get("quantization_config") or {}).get("weight_block_size", [128, 128])
        per_byte = 1 + 4 / (b[0] * b[1])  # fp8 value + its share of the block scale
        quant_repl = replicated - plain_repl
        quant_split = (total - replicated) - plain_split
        per_gpu_bytes = 2 * (plain_repl + plain_split / tp) + per_byte * (quant_repl + quant_split / tp)
    else:
        per_gpu_bytes = 2 * (replicated + (total - replicated) / tp)
    kv_per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * layers * 2  # every TP rank holds the latent
    return dict(tp=tp, total=total, per_gpu_bytes=per_gpu_bytes, kv_per_token=kv_per_token, fp8=fp8)


def compare(rows: list[dict], metrics_file: Path) -> None:
    """The last step's measured state bytes per stage (max over the stage's ranks) beside the prediction."""
    recs = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rec = [r for r in recs if any(k.startswith("mem/stage") for k in r)][-1]
    print(f"measured ({metrics_file}, step {rec.get('step')}), bytes per rank, max over the stage's ranks:")
    print(" stage  kind     predicted     measured   measured/predicted")
    for r in rows:
        for kind, pred in (("params", r["weights"]), ("grads", r["grads"]), ("optim", r["optim"]),
                           ("state", r["weights"] + r["grads"] + r["optim"])):
            got = rec.get(f"mem/stage{r['stage']}/{kind}_bytes_max")
            if got is not None:
                print(f" {r['stage']:5d}  {kind:6s} {pred:12,.0f} {got:12,.0f}   {got / pred:.3f}")
        cuda = rec.get(f"mem/stage{r['stage']}/cuda_peak_bytes_max")
        if cuda is not None:
            print(f" {r['stage']:5d}  GPU peak allocated {cuda / 2**20:,.0f} MiB (activations and engine buffers "
                  "included)")
        rss = rec.get(f"mem/stage{r['stage']}/peak_rss_bytes_max")
        if rss is not None:
            print(f" {r['stage']:5d}  peak RSS of the process {rss / 2**20:,.0f} MiB (runtime, libraries, engine "
                  f"included; state above is {(r['weights'] + r['grads'] + r['optim']) / 2**20:.1f} MiB)")


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
    ap.add_argument("--config", type=Path, default=Path(__file__).parent / "config.json", help="HF config.json")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--first-stage-layers", type=int, default=None, help="default: 3 (the full recipe's) when pp > 1")
    ap.add_argument("--last-stage-layers", type=int, default=None, help="default: 2 (the full recipe's) when pp > 1")
    ap.add_argument("--dtype", choices=sorted(BYTES), default="bf16", help="training parameter dtype")
    ap.add_argument("--engine-fp8", action="store_true", help="FP8 (block-scaled) engine weights")
    ap.add_argument("--measured", type=Path, default=None, help="a run's metrics.jsonl to compare with")
    a = ap.parse_args()
    if a.pp > 1:  # one stage has no split to declare
        a.first_stage_layers = 3 if a.first_stage_layers is None else a.first_stage_layers
        a.last_stage_layers = 2 if a.last_stage_layers is None else a.last_stage_layers
    c = json.loads(a.config.read_text())
    k = counts(c)
    rows = training(c, k, a.nodes, a.pp, a.ep, a.seq, a.mtp, a.gpus_per_node, a.first_stage_layers,
                    a.last_stage_layers, a.dtype)
    e = engine(c, k, a.engine_tp, a.engine_fp8)
    split = " | ".join(str(r["layers"]) for r in rows) if len(rows) <= 4 else \
        f"{rows[0]['layers']} | {rows[1]['layers']} ... | {rows[-1]['layers']}"
    print(f"{a.nodes} nodes x {a.gpus_per_node} GPUs, TP1 PP{a.pp} ({split} layers) EP{a.ep}, "
          f"DP {rows[0]['dp']}, expert DP {rows[0]['edp']}; {a.dtype}; micro-batch {a.seq} tokens; GPU {a.gpu_gb} GB")
    small = max(r["params"] for r in rows) < 1e8  # the scaled-down run: MB instead of GB
    unit, pu = (1e6, "M") if small else (GB, "B")
    uname = "MB" if small else "GB"
    print(f" stage params({pu}) weights grads optim(sharded) act(recompute) | train peak | gen: train w + engine w + KV"
          f"   [{uname}]")
    free_kv = []
    for r in rows:
        optim = 0.0 if a.cpu_offload else r["optim"]
        train_peak = r["weights"] + r["grads"] + optim + r["act"] + a.overhead_gb * GB
        # While the engine generates, grads and optimizer state are on the host (engine.offload_train) and
        # activations are gone; the training weights stay.
        kv = a.gpu_gb * GB - r["weights"] - e["per_gpu_bytes"] - a.overhead_gb * GB
        free_kv.append(kv)
        print(f" {r['stage']:5d} {r['params'] / 1e9 * GB / unit:9.2f} {r['weights'] / unit:7.1f} {r['grads'] / unit:5.1f} "
              f"{optim / unit:14.1f} {r['act'] / unit:14.1f} | {train_peak / unit:10.1f} | "
              f"{r['weights'] / unit:.1f} + {e['per_gpu_bytes'] / unit:.1f} + {kv / unit:.1f}")
    kv = min(free_kv)
    tokens = kv / e["kv_per_token"]
    wdt = "FP8" if e["fp8"] else "bf16"
    print(f"engine TP{e['tp']} x EP{e['tp']}: {e['total'] / 1e9 * GB / unit:.1f}{pu} params, "
          f"{e['per_gpu_bytes'] / unit:.1f} {uname} {wdt} per GPU;"
          f" MLA latent {e['kv_per_token']} B/token ({c['kv_lora_rank']}+{c['qk_rope_head_dim']}) x "
          f"{c['num_hidden_layers']} x 2; worst-stage KV room {kv / GB:.1f} GB = {tokens / 1e3:.0f}k tokens per engine")
    if a.measured is not None:
        compare(rows, a.measured)


if __name__ == "__main__":
    main()
