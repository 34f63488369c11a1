"""One end-to-end throughput table on one GPU: GRPO steps of a realistic shape against each phase's own floor,
all measured in the same run.

    source benchmarks/gpu_setup.sh && python3 benchmarks/gpu_e2e_step.py --out $OUT/e2e.json

1. A random-weight model of Qwen3-4B's dimensions (benchmarks/configs/qwen3_4b.json; bf16, written here on the GPU).
2. `mtrain train` on it, colocated, one rank: --prompts x --samples samples of --new-tokens response tokens per step,
   packed micro-batches, --steps steps (the first one is the warm-up: compilation, graph capture, Adam state).
   The loop's metrics give each phase: rollout, logprob recompute, train, sync, memory release / resume, step.
3. The floors, after the run has left the GPU:
   rollout  a standalone `sglang.Engine` with the run's server arguments, on the same number of requests of the
            run's mean prompt length, --new-tokens each (ignore_eos), timed twice after a warm-up
   train    the trainer's own Actor alone (logprob recompute + one optimizer step) on a batch of the run's shape
   sync     a device-to-device copy of the bytes the run's sync sent (the copy floor)
   memory   none (reported as measured)
Prints the table: per phase the run's median (min-max over the measured steps), its floor, the ratio; the step
against the sum of the floors; tokens/s/GPU end to end (generated tokens per step / step time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MODEL_CONFIG = REPO / "benchmarks" / "configs" / "qwen3_4b.json"
PHASES = ("time/rollout", "time/logprobs", "time/train", "time/sync", "time/release_memory", "time/resume_memory")


def write_random_model(out: Path) -> Path:
    """Qwen3-4B-shaped random bf16 weights straight from the GPU to safetensors (a CPU init of 4 B float32
    parameters would take minutes); norms at 1, everything else N(0, 0.02)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads(MODEL_CONFIG.read_text())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    shard, size, n = {}, 0, 0
    names = [(k, p.shape) for k, p in meta.state_dict().items() if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")]
    index = {}
    for i, (name, shape) in enumerate(names):
        t = (torch.ones(shape, dtype=torch.bfloat16, device="cuda") if "norm" in name else
             (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16))
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size > (2 << 30) or i == len(names) - 1:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16"), indent=1))
    return out


def run_training(args, hf: Path, run_dir: Path) -> list[dict]:
    overrides = [f"model.hf_path={hf}", "model.dtype=bfloat16", "engine.kind=sglang",
                 f"engine.mem_fraction_static={args.mem_fraction}", f"rollout.prompts_per_step={args.prompts}",
                 f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
                 "rollout.max_prompt_len=64", "rollout.temperature=1.0",
                 f"train.max_tokens_per_micro_batch={args.budget}", f"train.steps={args.steps}",
                 "train.save_interval=-1", "train.eval_interval=0", f"train.run_dir={run_dir}",
                 f"data.arithmetic.num_train={args.prompts * args.steps}", *args.extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mtrain", "train",
           str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), *overrides]
    print(" ".join(cmd), flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=str(run_dir.parent), text=True, capture_output=True)
    (run_dir.parent / "train.log").write_text(p.stdout + p.stderr)
    print(f"training exit {p.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
    if p.returncode:
        print((p.stdout + p.stderr)[-4000:], flush=True)
        sys.exit(1)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rollout_floor(args, hf: Path, prompt_len: int, n: int) -> dict:
    """A standalone sglang.Engine with the server arguments the run's engine got (rollout/sglang_wire.py plus
    trainer/engines.production_server_args of the same rollout shape), n requests of --new-tokens each."""
    from gpu_engine_parity import run_standalone
    from mtrain.config import load_config
    from mtrain.trainer.engines import production_server_args
    cfg = load_config(None, [f"model.hf_path={hf}", "data.task=arithmetic", "model.dtype=bfloat16",
                             "engine.kind=sglang", f"rollout.prompts_per_step={args.prompts}",
                             f"rollout.samples_per_prompt={args.samples}"])
    extra = {"dtype": "bfloat16", **production_server_args(cfg)}
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    return run_standalone(str(hf), extra, [n], args.new_tokens, 2, vocab, mem_fraction=args.mem_fraction,
                          prompt_len=prompt_len)


def train_floor(args, hf: Path, prompt_len: int, response_len: int, n: int) -> list[float]:
    from bench_train_throughput import make_batch, one_step, single_process_env
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.trainer.learner.actor import Actor
    from mtrain.trainer.engines import weight_loader
    from mtrain.layouts import model_layout
    single_process_env()
    cfg = load_config(str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), [
        f"model.hf_path={hf}", "model.dtype=bfloat16", f"train.max_tokens_per_micro_batch={args.budget}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}", *args.extra])
    init_distributed(seed=1)
    hf_cfg = json.loads((hf / "config.json").read_text())
    actor = Actor(cfg, hf_cfg, load_weights=weight_loader(cfg, model_layout(hf_cfg, mtp=False), 0))
    batch = make_batch([(prompt_len, response_len)] * n, hf_cfg["vocab_size"], seed=0)
    one_step(actor, batch)  # warm-up: Adam state, kernels
    return [one_step(actor, batch) for _ in range(args.floor_repeats)]


def copy_floor(nbytes: int, repeats: int = 5) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return out[1:]


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/e2e")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--steps", type=int, default=4, help="training steps; the first is the warm-up")
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="engine.mem_fraction_static: SGLang's share of the whole GPU, the trainer's memory included")
    ap.add_argument("--floor-repeats", type=int, default=3)
    ap.add_argument("--skip-train", action="store_true", help="reuse the metrics of a previous run in --work")
    ap.add_argument("--train-only", action="store_true", help="stop after the run (the floors in a later call)")
    ap.add_argument("--out", default=None)
    ap.add_argument("extra", nargs="*", help="further a.b.c=value overrides for the run (and the train floor)")
    args = ap.parse_args()
    work = Path(args.work)
    hf = work / "hf"
    if not (hf / "config.json").exists():
        t = time.perf_counter()
        write_random_model(hf)
        print(f"random model written in {time.perf_counter() - t:.0f} s", flush=True)
    run_dir = work / "run"
    if args.skip_train:
        metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_training(args, hf, run_dir)
        if args.train_only:
            return
    steps = [m for m in metrics if "time/step" in m][1:]  # the first step is the warm-up
    n = args.prompts * args.samples
    res = {"config": vars(args), "steps": steps}
    phases = {k: spread([m.get(k, 0.0) for m in steps]) for k in PHASES + ("time/step",)}
    gen_tokens = [m["response_len/mean"] * n for m in steps]
    prompt_len = round(statistics.mean(m["prompt_len/mean"] for m in steps))  # the floors' requests: the run's shape
    response_len = round(statistics.mean(m["response_len/mean"] for m in steps))
    floors = {}
    floors["rollout"] = rollout_floor(args, hf, prompt_len, n)
    floors["train"] = spread(train_floor(args, hf, prompt_len, response_len, n))
    floors["sync"] = spread(copy_floor(int(statistics.median(m["sync/bytes"] for m in steps))))
    roll_tok_s = floors["rollout"][str(n)]["median_tok_s"]
    f_roll = statistics.mean(gen_tokens) / roll_tok_s
    f_train, f_sync = floors["train"]["median"], floors["sync"]["median"]
    res.update(phases=phases, floors=floors, floor_s={"rollout": f_roll, "train": f_train, "sync": f_sync})
    step = phases["time/step"]["median"]
    res["step_over_floors"] = step / (f_roll + f_train + f_sync)
    res["tokens_per_s_per_gpu"] = spread([g / m["time/step"] for g, m in zip(gen_tokens, steps)])
    lines = [f"{'phase':<16}{'run median (min-max) s':>28}{'floor s':>10}{'ratio':>8}"]
    for label, key, floor in (("rollout", "time/rollout", f_roll), ("logprobs+train", None, f_train),
                              ("sync", "time/sync", f_sync), ("release memory", "time/release_memory", None),
                              ("resume memory", "time/resume_memory", None), ("step", "time/step",
                                                                             f_roll + f_train + f_sync)):
        if key is None:
            xs = [m["time/logprobs"] + m["time/train"] - m.get("time/release_memory", 0.0) for m in steps]
            s = spread(xs)
        else:
            s = phases[key]
        ratio = f"{s['median'] / floor:.2f}" if floor else "-"
        lines.append(f"{label:<16}{s['median']:>12.3f} ({s['min']:.3f}-{s['max']:.3f}){'':>2}"
                     f"{(floor or 0):>10.3f}{ratio:>8}")
    tps = res["tokens_per_s_per_gpu"]
    lines.append(f"end to end: {tps['median']:.0f} generated tokens/s/GPU ({tps['min']:.0f}-{tps['max']:.0f}), "
                 f"{n} samples x {response_len} response tokens (mean), prompt {prompt_len}; "
                 f"step / sum of floors = {res['step_over_floors']:.2f}")
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
