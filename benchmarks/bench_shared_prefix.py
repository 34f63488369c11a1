"""train.shared_prefix on the CPU or one GPU: the trainer's packed forward + backward over a batch of GRPO groups, each
group's prompt packed once (the tree stream, docs/design-shared-prefix.md) against every row packed whole (the
ordinary packed path), same process, same model and weights, repeats interleaved.

Per case it prints the stream tokens each path computes, the step time (median, min-max over the repeats), the
ratio unshared / shared, and the max |diff| of the sampled-token logprobs between the two paths (float32; the
float64 equality is tests/trainer/test_shared_prefix.py). A step is what the Actor's train micro-batch loop runs
per micro-batch (mtrain/trainer/learner/actor.py): plan the micro-batches under train.max_tokens_per_micro_batch
(packing.plan_micro_batches, or prefix_tree.plan_shared_micro_batches), build the pack, run the Megatron model
(mtrain's local attention, per-token RoPE) on the stream, unpack the logprobs, backward of a loss over the response
positions. No optimizer step (the same for both paths), no engine.

Cases:
  long_prompt  prompts of --prompt-len tokens (default 2,048), --samples 8 responses of 64-256 tokens each;
  multi_turn   a tool task's shape: a --mt-prompt-len prompt (system, tool schema, question), then per sample three
               assistant turns with two tool results between them (the response holds all turns; tool tokens are
               masked out of the loss). The planner shares the longest common prefix of a group's rows, which in
               a tool rollout is the prompt: each sample's turns are its own.

On a GPU (`--dtype bfloat16`, the model where the Actor builds it, CUDA) the same, timed with synchronisation; the
logprob difference is then bf16's (a different summation order over the same values), stated, not checked.

    # one case per call, as docs/results.md ran them: 2-6 min each on 2 busy cores
    OMP_NUM_THREADS=1 python benchmarks/bench_shared_prefix.py --cases long_prompt --repeats 5 --json out.json
    OMP_NUM_THREADS=1 python benchmarks/bench_shared_prefix.py --cases multi_turn --repeats 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _hf(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, max_pos: int) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                rope_theta=10000.0, attention_bias=False, mlp_bias=False, attention_dropout=0.0, bos_token_id=1,
                eos_token_id=2, initializer_range=0.02, max_position_embeddings=max_pos, hidden_size=hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=False)


def long_prompt_rows(groups: int, samples: int, prompt_len: int, vocab: int, seed: int):
    """(token rows, group keys, loss mask rows): one prompt per group, responses of 64-256 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows, keys, masks = [], [], []
    for k in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(samples):
            n = int(torch.randint(64, 257, (1,), generator=g))
            rows.append(prompt + torch.randint(3, vocab, (n,), generator=g).tolist())
            keys.append(k)
            masks.append([False] * prompt_len + [True] * n)
    return rows, keys, masks


def multi_turn_rows(groups: int, samples: int, prompt_len: int, vocab: int, seed: int):
    """A tool task's rows: prompt, then assistant (32-96) / tool result (128-256) / assistant / tool / final
    assistant (32-96); the loss covers the assistant turns only."""
    g = torch.Generator().manual_seed(seed)

    def seg(lo, hi):
        return torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    rows, keys, masks = [], [], []
    for k in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(samples):
            toks, mask = list(prompt), [False] * prompt_len
            for turn, (lo, hi, train) in enumerate([(32, 96, True), (128, 256, False), (32, 96, True),
                                                    (128, 256, False), (32, 96, True)]):
                s = seg(lo, hi)
                toks += s
                mask += [train] * len(s)
            rows.append(toks)
            keys.append(k)
            masks.append(mask)
    return rows, keys, masks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="long_prompt,multi_turn")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--mt-prompt-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=8192, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (bfloat16: the GPU's; the step then runs where the Actor built it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # one process: init_distributed defaults RANK/WORLD_SIZE and picks a free MASTER_PORT
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.trainer.learner.actor import Actor, token_logprobs
    from mtrain.trainer.packing import make_pack, pack, plan_micro_batches, unpack
    from mtrain.trainer.prefix_tree import make_tree_pack, plan_shared_micro_batches

    init_distributed(seed=0)
    hf = _hf(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab, 8192)
    cfg = load_config(REPO / "mtrain/configs/tiny_llama_grpo.yaml",
                      ["model.hf_path=unused", f"train.max_tokens_per_micro_batch={args.budget}",
                       "train.shared_prefix=true", "algo.kl_coef=0", f"model.dtype={args.dtype}"])
    actor = Actor(cfg, hf, trainable=False)
    assert actor.rope_per_token, "the tree stream needs mtrain's local attention with per-token RoPE"
    model = actor.chunks[0] if args.dtype == "bfloat16" else actor.chunks[0].float()
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for p in model.parameters():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama shape hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV, "
          f"ffn {args.ffn}, vocab {args.vocab}: {n_params / 1e6:.1f} M parameters, {args.dtype} on {device}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    results = {}
    for case in [c for c in args.cases.split(",") if c]:
        make = long_prompt_rows if case == "long_prompt" else multi_turn_rows
        plen = args.prompt_len if case == "long_prompt" else args.mt_prompt_len
        rows, keys, masks = make(args.groups, args.samples, plen, args.vocab, seed=1)
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        loss_mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
        for i, (r, m) in enumerate(zip(rows, masks)):
            tokens[i, :len(r)] = torch.tensor(r)
            loss_mask[i, :len(r) - 1] = torch.tensor(m[1:])  # position j predicts token j + 1
        plans = {"unshared": plan_micro_batches([len(r) for r in rows], args.budget),
                 "shared": plan_shared_micro_batches(rows, keys, args.budget)}

        def build(mode, mb):
            if mode == "unshared":
                return make_pack(mb, [len(rows[i]) for i in mb])
            return make_tree_pack(mb, [rows[i] for i in mb], [keys[i] for i in mb])

        def step(mode):
            """One training pass over the batch; returns (seconds, stream tokens, [B, W-1] logprobs)."""
            lp_rows = torch.zeros(len(rows), width - 1)
            total = 0
            sync()
            t0 = time.perf_counter()
            for mb in plans[mode]:
                pk = build(mode, mb)
                total += pk.total
                idx = torch.tensor(mb)
                stream = pack(pk, tokens, width, "tokens").unsqueeze(0).to(device)  # pk.rows index the whole batch
                pos = pk.position_ids().to(device)
                logits = model(stream, pos, None, packed_seq_params=pk.packed_seq_params(device.type, True, pos))
                lp = unpack(pk, token_logprobs(logits, stream, args.vocab, 1.0)[0].float(), width - 1, width)
                m = loss_mask[idx].to(device)
                loss = -torch.where(m, lp, torch.zeros((), device=device)).sum() / m.sum()
                loss.backward()
                lp_rows[idx] = lp.detach().cpu()
            model.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - t0, total, lp_rows

        step("shared")  # warm-up (allocator, first-call paths), not timed
        times = {"unshared": [], "shared": []}
        tok, lps = {}, {}
        for r in range(args.repeats):
            for mode in (("unshared", "shared") if r % 2 == 0 else ("shared", "unshared")):
                dt, tok[mode], lps[mode] = step(mode)
                times[mode].append(dt)
                print(f"  {case} repeat {r} {mode}: {dt:.2f} s", flush=True)
        valid = loss_mask
        diff = float((lps["shared"] - lps["unshared"]).abs()[valid].max())
        med = {m: statistics.median(v) for m, v in times.items()}
        row_tokens = sum(len(r) for r in rows)
        res = {"groups": args.groups, "samples": args.samples, "prompt_len": plen, "row_tokens": row_tokens,
               "stream_tokens": tok, "micro_batches": {m: len(p) for m, p in plans.items()},
               "step_s": {m: {"median": med[m], "min": min(v), "max": max(v), "all": v} for m, v in times.items()},
               "speedup_median": med["unshared"] / med["shared"],
               "speedup_range": [min(times["unshared"]) / max(times["shared"]),
                                 max(times["unshared"]) / min(times["shared"])],
               # each interleaved pair's own ratio: the box's load drifts between pairs more than within one
               "speedup_pairs": [u / v for u, v in zip(times["unshared"], times["shared"])],
               "logprob_max_abs_diff": diff}
        results[case] = res
        print(f"{case}: {args.groups} groups x {args.samples} samples, prompt {plen} tokens; stream tokens "
              f"unshared {tok['unshared']} / shared {tok['shared']} ({tok['unshared'] / tok['shared']:.2f}x fewer); "
              f"micro-batches {res['micro_batches']['unshared']} / {res['micro_batches']['shared']}")
        for m in ("unshared", "shared"):
            s = res["step_s"][m]
            print(f"  {m:9s} step {s['median']:.2f} s (min {s['min']:.2f}, max {s['max']:.2f}, "
                  f"{args.repeats} repeats)")
        pairs = res["speedup_pairs"]
        print(f"  speed-up {res['speedup_median']:.2f}x (median/median; per interleaved pair median "
              f"{statistics.median(pairs):.2f}x, {min(pairs):.2f}-{max(pairs):.2f}); logprob max |diff| {diff:.2e}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
