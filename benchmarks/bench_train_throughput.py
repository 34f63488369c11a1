"""The trainer's own step (logprob recompute + train forward/backward + optimizer step) on a Llama-shaped model:
padded vs packed micro-batches on one heavy-tailed RL-like batch, and fixed-length batches as the ceiling, all
in the same run. Prints tokens/s and model TFLOP/s (useful tokens only), and the ratios.

    # H200 (one GPU, bf16): Llama-3.2-1B shape, lengths up to 4096
    python benchmarks/bench_train_throughput.py --model 1b --samples 128 --max-len 4096 --mbs 2 --budget 8192 \
        --fixed-len 2048 --steps 3 --warmup 1 --out docs/gpu-runs/train_throughput_1b.json
    # CPU smoke (float32); --dtype bfloat16 --profile for the noise floor and the profiler summary at a tiny size
    python benchmarks/bench_train_throughput.py --model tiny --samples 32 --max-len 256 --mbs 2 --budget 512 \
        --fixed-len 128 --steps 2 --warmup 1

Modes (the same Actor, the same weights, one after another in each round):
  padded   today's path: every row padded to the batch's longest sample, micro-batches of --mbs samples
  packed   train.max_tokens_per_micro_batch=--budget: samples packed end to end (THD), no padding computed
  ceiling  samples all exactly --fixed-len tokens, micro-batches of budget // fixed-len samples (no padding)
  ceiling_packed  the same fixed-length batch through the packed path (--budget): packed / ceiling_packed is the
           cost of variable lengths alone, with the attention kernels held equal (the ceiling runs Megatron's
           local unfused attention, the packed path flash varlen on a GPU, so packed can beat the ceiling)

Model FLOPs (what "TFLOP/s" counts; padding never counts), Llama with SwiGLU and GQA, per sequence of L tokens:
  linear = 2 * L * [layers * (h*q + 2*h*kv + q*h + 3*h*ffn) + h*vocab]      (q = heads*head_dim, kv = kv_heads*head_dim)
  attn   = layers * 4 * q * L*(L+1)/2                                        (QK^T and PV, causal: lower triangle)
  step   = 4 * sum(linear + attn)      (1 forward for the logprob recompute, 3 for the train forward + backward)
Megatron's own reports count full (non-causal) S^2 attention and recomputation, so its TFLOP/s reads higher for
the same time; MFU here is TFLOP/s / --peak-tflops (H200 dense bf16: 989).

Numerics: the packed-vs-padded logprob difference on the heavy-tailed batch is printed beside a noise floor
measured in the same run on the same weights: padded at --mbs vs padded at 1 sample per micro-batch (the same
path, only the micro-batch shapes differ) and packed vs packed with the samples in reverse order (other
streams, other neighbours). In bf16 a packed difference of the floor's size is rounding, not a bug.
--profile: after the timed rounds, one more step per mode under torch.profiler (benchmarks/train_profile.py), packed
and ceiling_packed first, padded last (--profile-modes picks and orders them; the JSON is rewritten after each):
top ops by self CUDA and self CPU time with call counts, kernel launches, host-device syncs, GPU busy fraction;
into the JSON ("profile") and a readable text file (--profile-txt, default next to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/train_profile.py for --profile
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
             rope_theta=500000.0, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
             bos_token_id=1, eos_token_id=2, initializer_range=0.02, max_position_embeddings=131072)
MODELS = {  # Llama-3.x shapes (hidden, layers, heads, kv heads, ffn, vocab, tied)
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=768, vocab_size=4096, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),  # Adam state: > 1 H200
}


PROFILE_ORDER = ("packed", "ceiling_packed", "ceiling", "padded")  # --profile: the packed modes first


def model_flops(hf: dict, lengths: list[int]) -> float:
    """Model FLOPs of one trainer step over sequences of these lengths (formula in the module docstring)."""
    h, layers, ffn, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    d = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    per_token = 2 * (layers * (h * q + 2 * h * kv + q * h + 3 * h * ffn) + h * vocab)
    fwd = sum(n * per_token + layers * 4 * q * n * (n + 1) / 2 for n in lengths)
    return 4.0 * fwd


def heavy_tailed_lengths(n: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform in [max_len/32, max_len/8], responses max_len * u^4 (most
    short, a few near the cap; mean about a fifth of the room), like RL rollouts with a length limit."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(max(2, max_len // 32), max(3, max_len // 8), (1,), generator=g))
        room = max_len - p
        r = max(1, min(room, int(8 + (room - 8) * float(torch.rand(1, generator=g)) ** 4)))
        out.append((p, r))
    return out


def make_batch(shapes: list[tuple[int, int]], vocab: int, seed: int):
    from mtrain.rollout.protocol import Completion
    from mtrain.trainer.batch import build_batch
    g = torch.Generator().manual_seed(seed)
    comps = []
    for i, (p, r) in enumerate(shapes):
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        comps.append(Completion(rid=str(i), prompt_ids=ids[:p], output_ids=ids[p:], logprobs=[-1.0] * r,
                                finish_reason="length", weight_version=0))
    return build_batch(comps, [float(i % 2) for i in range(len(shapes))], pad_id=0)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_step(actor, batch) -> float:
    """Seconds for the trainer's step on this batch: logprob recompute, then one optimizer step."""
    from torch.profiler import record_function  # labels the two phases in --profile traces; no cost otherwise
    _sync()
    t0 = time.perf_counter()
    with record_function("bench/logprob_recompute"):
        old = actor.logprobs(batch)
    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    norms = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(batch.size)}
    with record_function("bench/train_step"):
        actor.train_step(batch, old, adv, None, norms)
    _sync()
    return time.perf_counter() - t0


def logprob_diff(a: torch.Tensor, b: torch.Tensor, batch) -> dict:
    """max and mean |a - b| over every real predicting position of the batch."""
    valid = torch.arange(batch.tokens.shape[1] - 1)[None, :] < (batch.seq_lens[:, None] - 1)
    d = (a - b).abs()[valid]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def _unwrapped(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def float32_reference_logprobs(actor, cfg_ref, hf: dict, batch) -> torch.Tensor:
    """Logprobs of the same weights (the trained model's bf16 values, exactly) in float32 on the padded path:
    the yardstick for both bf16 paths' rounding."""
    from mtrain.trainer.learner.actor import Actor

    def load(chunks):
        for dst, src in zip(chunks, actor.chunks):
            sd = _unwrapped(src).state_dict()
            dst.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                 for k, v in sd.items()}, strict=True)
    ref = Actor(cfg_ref, hf, load_weights=load, trainable=False)
    lp = ref.logprobs(batch)
    del ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return lp


def logprob_numerics(actor, batch, cfgs: dict, hf: dict) -> dict:
    """Packed vs padded logprobs on the batch, the noise floor beside them (module docstring), and, with
    cfgs["float32"], each path against the same weights in float32. cfgs holds the configs "padded", "packed",
    "padded_mbs1" (and "float32" or None)."""
    lp = {}
    for m in ("padded", "packed", "padded_mbs1"):
        actor.cfg = cfgs[m]
        lp[m] = actor.logprobs(batch)
    rev = torch.arange(batch.size - 1, -1, -1)
    actor.cfg = cfgs["packed"]
    lp_rev = actor.logprobs(batch.select(rev))[rev]  # back in the batch's own order
    out = {"packed_vs_padded": logprob_diff(lp["packed"], lp["padded"], batch),
           "floor_padded_vs_padded_mbs1": logprob_diff(lp["padded"], lp["padded_mbs1"], batch),
           "floor_packed_vs_packed_reversed": logprob_diff(lp["packed"], lp_rev, batch)}
    if cfgs.get("float32") is not None:
        ref = float32_reference_logprobs(actor, cfgs["float32"], hf, batch)
        out["padded_vs_float32"] = logprob_diff(lp["padded"], ref, batch)
        out["packed_vs_float32"] = logprob_diff(lp["packed"], ref, batch)
    return out



def single_process_env() -> None:
    """torch.distributed's variables for a one-rank run outside torchrun (a free port for the store)."""
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="1b")
    ap.add_argument("--samples", type=int, default=128, help="samples in the heavy-tailed batch")
    ap.add_argument("--max-len", type=int, default=4096, help="prompt + response cap")
    ap.add_argument("--mbs", type=int, default=2, help="padded mode: samples per micro-batch")
    ap.add_argument("--budget", type=int, default=8192, help="packed mode: tokens per micro-batch")
    ap.add_argument("--fixed-len", type=int, default=2048, help="ceiling mode: length of every sample")
    ap.add_argument("--steps", type=int, default=3, help="measured rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="for MFU; default 989 on CUDA (H200 bf16)")
    ap.add_argument("--out", type=str, default=None, help="write the results as JSON here too")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="model dtype; default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--fp32-reference", action=argparse.BooleanOptionalAction, default=True,
                    help="with a bf16 model: also score the batch with the same weights in float32 (padded path) "
                         "and report each bf16 path's difference from it")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, profile one more step per mode (module docstring): packed and "
                         "ceiling_packed first, then ceiling, padded last (the slowest; a GPU call is cut at ~400 s)")
    ap.add_argument("--profile-modes", type=str, default=",".join(PROFILE_ORDER),
                    help="with --profile: which modes to profile, in this order (comma-separated); e.g. "
                         "packed,ceiling_packed,ceiling to leave the 20 s padded step out")
    ap.add_argument("--profile-txt", type=str, default=None,
                    help="readable profile summary; default: --out with .profile.txt, else ./train_profile.txt")
    ap.add_argument("--trace-dir", type=str, default=None,
                    help="with --profile: also write each mode's chrome trace (<mode>.json.gz) here (large)")
    args = ap.parse_args()
    if args.budget < args.max_len or args.budget % args.fixed_len:
        raise SystemExit(f"--budget ({args.budget}) must be >= --max-len ({args.max_len}) and a multiple of "
                         f"--fixed-len ({args.fixed_len})")

    single_process_env()
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.models import varlen_attention
    from mtrain.trainer.learner.actor import Actor

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    hf = dict(LLAMA, **MODELS[args.model])
    init_distributed(seed=args.seed)
    per_micro_fixed = args.budget // args.fixed_len
    if args.samples % args.mbs:
        raise SystemExit(f"--samples ({args.samples}) must be a multiple of --mbs ({args.mbs})")
    # The Actor reads the micro-batch keys; the rollout keys only have to pass the config's own checks.
    base = [f"model.hf_path={REPO}", f"model.dtype={dtype}",
            "rollout.max_prompt_len=8", f"rollout.max_new_tokens={args.max_len - 8}", "optim.lr=1e-7",
            "optim.use_distributed_optimizer=false", "algo.kl_coef=0",
            f"rollout.prompts_per_step={args.mbs * per_micro_fixed}", "rollout.samples_per_prompt=2"]

    def config(*extra):
        return load_config(REPO / "mtrain/configs/tiny_llama_grpo.yaml", base + list(extra))
    cfg_padded = config(f"train.micro_batch_size={args.mbs}")
    cfg_packed = config(f"train.max_tokens_per_micro_batch={args.budget}")
    cfg_fixed = config(f"train.micro_batch_size={per_micro_fixed}")
    cfg_padded_mbs1 = config("train.micro_batch_size=1")  # for the noise floor only
    actor = Actor(cfg_packed, hf)

    shapes = heavy_tailed_lengths(args.samples, args.max_len, args.seed)
    batch = make_batch(shapes, hf["vocab_size"], args.seed)
    useful = int(batch.seq_lens.sum())
    # the ceiling: about as many tokens, every sample exactly fixed-len, whole micro-batches
    n_fixed = max(per_micro_fixed, round(useful / args.fixed_len / per_micro_fixed) * per_micro_fixed)
    fixed = make_batch([(args.fixed_len // 2, args.fixed_len - args.fixed_len // 2)] * n_fixed, hf["vocab_size"],
                       args.seed + 1)
    modes = {"padded": (cfg_padded, batch), "packed": (cfg_packed, batch), "ceiling": (cfg_fixed, fixed),
             "ceiling_packed": (cfg_packed, fixed)}
    # Numerics on this machine (bf16 flash packed vs Megatron's padded local attention on a GPU): the two paths'
    # logprobs on every real position of the heavy-tailed batch, and the noise floor, before any timed step.
    cfg_ref = config("model.dtype=float32", f"train.micro_batch_size={args.mbs}") \
        if args.fp32_reference and dtype != "float32" else None
    numerics = logprob_numerics(actor, batch, {"padded": cfg_padded, "packed": cfg_packed,
                                               "padded_mbs1": cfg_padded_mbs1, "float32": cfg_ref}, hf)
    lp_diff = numerics["packed_vs_padded"]
    print(f"setup {time.perf_counter() - t_start:.1f} s (actor, batches, packed vs padded logprob check)", flush=True)
    times = {m: [] for m in modes}
    peak = args.peak_tflops or (989.0 if cuda else None)

    def report() -> dict:  # from the rounds measured so far; written after each round, so a cut run leaves them
        results = {}
        for m, (cfg, b) in modes.items():
            lengths = b.seq_lens.tolist()
            t = statistics.median(times[m])
            tflops = model_flops(hf, lengths) / t / 1e12
            results[m] = {"seconds": t, "useful_tokens": int(sum(lengths)), "computed_slots":
                          int(b.size * b.tokens.shape[1]) if m != "packed" else int(sum(lengths)),
                          "tokens_per_s": sum(lengths) / t, "tflops": tflops,
                          "mfu": tflops / peak if peak else None, "all_seconds": times[m]}
        out = {
            "machine": torch.cuda.get_device_name() if cuda else
            f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(args),
            "model": args.model, "dtype": dtype, "torch": torch.__version__, "results": results,
            "rounds_measured": len(times["ceiling"]),
            "length_stats": {"mean": useful / len(shapes), "max": int(batch.seq_lens.max()),
                             "padded_width": int(batch.tokens.shape[1])},
            "logprob_packed_vs_padded": lp_diff, "logprob_numerics": numerics,
            "packed_attention": {"paths": sorted(varlen_attention.PATHS_USED),
                                 "varlen_error": varlen_attention.VARLEN_ERROR[:1]},
            "packed_over_padded_tokens_per_s": results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"],
            "packed_over_ceiling_tflops": results["packed"]["tflops"] / results["ceiling"]["tflops"],
            "packed_over_ceiling_tokens_per_s": results["packed"]["tokens_per_s"] /
            results["ceiling"]["tokens_per_s"],
            "padded_over_ceiling_tflops": results["padded"]["tflops"] / results["ceiling"]["tflops"],
            "packed_over_ceiling_packed_tokens_per_s": results["packed"]["tokens_per_s"] /
            results["ceiling_packed"]["tokens_per_s"],
        }
        if profiles:
            out["profile"] = profiles
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
        return out

    profiles: dict = {}

    out = None
    for rnd in range(args.warmup + args.steps):
        for m, (cfg, b) in modes.items():
            actor.cfg = cfg
            dt = one_step(actor, b)
            print(f"round {rnd}{' (warm-up)' if rnd < args.warmup else ''} {m}: {dt:.3f} s", flush=True)
            if rnd >= args.warmup:
                times[m].append(dt)
        if rnd >= args.warmup:
            out = report()
    if args.profile:
        out = run_profiles(args, actor, modes, profiles, report)
    results = out["results"]
    for m, r in results.items():
        print(f"{m:14s} {r['seconds']:8.3f} s  {r['useful_tokens']:8d} useful tokens  {r['tokens_per_s']:10.1f} tok/s  "
              f"{r['tflops']:8.3f} TFLOP/s" + (f"  MFU {r['mfu']:.3f}" if r["mfu"] else ""))
    for k in ("packed_over_padded_tokens_per_s", "packed_over_ceiling_tflops", "packed_over_ceiling_tokens_per_s",
              "padded_over_ceiling_tflops", "packed_over_ceiling_packed_tokens_per_s"):
        print(f"{k}: {out[k]:.3f}")
    for k, v in numerics.items():
        print(f"logprobs {k.replace('_', ' ')}: max |diff| {v['max_abs']:.3g}, mean {v['mean_abs']:.3g}")
    print(f"packed attention ran: {out['packed_attention']}")
    print(json.dumps({k: v for k, v in out.items() if k != "profile"}))


def run_profiles(args, actor, modes: dict, profiles: dict, report) -> dict:
    """One more step per mode under torch.profiler, in --profile-modes order (packed first: the mode in
    question; padded last: the slowest); after each mode the JSON and the text summary are rewritten, so a run
    cut short keeps the profiles it finished."""
    from train_profile import format_profiles, profile_step
    order = [m.strip() for m in args.profile_modes.split(",") if m.strip()]
    unknown = [m for m in order if m not in modes]
    if unknown:
        raise SystemExit(f"--profile-modes: unknown mode(s) {unknown}; choose from {sorted(modes)}")
    path = Path(args.profile_txt or (Path(args.out).with_suffix(".profile.txt") if args.out else "train_profile.txt"))
    path.parent.mkdir(parents=True, exist_ok=True)
    out = None
    for m in order:
        cfg, b = modes[m]
        actor.cfg = cfg
        trace = str(Path(args.trace_dir) / f"{m}.json.gz") if args.trace_dir else None
        if trace:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        profiles[m] = profile_step(lambda: one_step(actor, b), trace_path=trace)
        print(f"profiled {m}: {profiles[m]['wall_s']:.3f} s under the profiler", flush=True)
        path.write_text(format_profiles(profiles))
        out = report()
    print(format_profiles(profiles))
    print(f"profile summary written to {path}")
    return out if out is not None else report()


if __name__ == "__main__":
    main()
