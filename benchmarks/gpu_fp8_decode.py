"""Rollout tokens/s of a block-FP8 SGLang engine against a bf16 one on the same model, several timed batches each.

    source benchmarks/gpu_setup.sh
    python benchmarks/gpu_fp8_decode.py --model qwen3moe12l --out $OUT/fp8_decode
    python benchmarks/gpu_fp8_decode.py --model llama8b --fp8-backends triton

gpu_fp8_sync.py times one generate batch after a 2-request warm-up, so the Triton kernels that a 64-request batch
compiles for its own shapes (prefill M, MoE configs) may run their JIT inside the timed batch, and one batch has no
spread. Here each engine first runs the whole batch once untimed, then --reps timed batches (all kept).
Weights: random bf16 (normal * 0.02, norms 1) by HF names, each generated on the GPU; the FP8 engine gets them
quantized per 128x128 block as DeepSeek's release format (`gpu_fp8_sync.fp8_checkpoint`), both through SGLang's own
HF-names loader. Greedy, 16-token random prompts, --new-tokens each. --fp8-backends: SGLang's
`fp8_gemm_runner_backend` for each FP8 engine (triton is mtrain's default: no DeepGEMM in the bundle); a backend that
fails is reported and skipped. --cuda-graphs: decode CUDA graphs in every engine (our engines start without; an FP8
engine may use them when its model captured no KV scales, checked at the first sync: sglang_loader.
check_graph_kv_scales). Writes <out>/gpu_fp8_decode_<model>[_graphs].json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import CONFIGS  # noqa: E402
from gpu_fp8_sync import fp8_checkpoint, guarded, prompts  # noqa: E402


def random_hf_weights(cfg: dict, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of the model by HF name (transformers' own names and shapes, from a meta model)."""
    from transformers import AutoModelForCausalLM

    from mtrain.rollout.reference_engine import as_hf_config, hf_disk_views
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(as_hf_config(cfg))
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, t in hf_disk_views(model).items():
        if "norm" in name:
            out[name] = torch.ones(t.shape, dtype=torch.bfloat16, device=device)
        else:
            out[name] = (torch.randn(t.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return out


def tokens_per_s(eng, batch: list[list[int]], new_tokens: int, reps: int) -> dict:
    from mtrain.rollout.protocol import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)

    def once(tag: str):
        reqs = [Request(rid=f"{tag}{i}-", prompt_ids=p, params=params) for i, p in enumerate(batch)]
        t0 = time.perf_counter()
        out = eng.generate(reqs)
        return sum(len(c.output_ids) for c in out) / (time.perf_counter() - t0), out

    warm, out = once("warm")  # whole batch, untimed: every kernel this batch shape needs is compiled here
    runs = [once(f"r{r}-")[0] for r in range(reps)]
    return {"warmup_tokens_per_s": warm, "tokens_per_s_runs": runs, "median": statistics.median(runs),
            "min": min(runs), "max": max(runs), "generated_tokens": sum(len(c.output_ids) for c in out),
            "first_tokens": [c.output_ids[0] if c.output_ids else None for c in out]}


def run_engine(model_dir: str, server_args: dict, weights, batch, args) -> dict:
    from mtrain.rollout.sglang_engine import SGLangEngine

    t0 = time.perf_counter()
    eng = SGLangEngine(model_dir, tp_size=1, mem_fraction_static=0.35, load_format="dummy",
                       server_args={"dtype": "bfloat16", **server_args})
    try:
        start = time.perf_counter() - t0
        eng.update_weights_hf_names(weights)  # SGLang's own loader
        eng.finish_weight_update(1)  # a sync's end: KV scales to 1.0, and with graphs the check that none were captured
        res = tokens_per_s(eng, batch, args.new_tokens, args.reps)
        res["engine_start_s"] = start
        return res
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="qwen3moe12l")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON (default $OUT)")
    ap.add_argument("--gen", type=int, default=64, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed batches per engine (all kept)")
    ap.add_argument("--fp8-backends", default="triton", help="comma-separated fp8_gemm_runner_backend values")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="every engine with decode CUDA graphs (up to --gen requests); default: without, as our "
                         "engines start")
    args = ap.parse_args()
    if args.reps < 1 or args.gen < 1 or args.new_tokens < 1:
        ap.error("--reps, --gen and --new-tokens must be positive")

    from mtrain.layouts import model_layout
    from mtrain.rollout.fp8_engine import SERVER_ARGS, fp8_config

    cfg = CONFIGS[args.model]
    layout = model_layout(cfg)
    hf = random_hf_weights(cfg)
    ckpt = fp8_checkpoint(hf, layout)
    work = tempfile.mkdtemp(prefix="mtrain-fp8-decode-")
    dirs = {"fp8": fp8_config(dict(cfg, torch_dtype="bfloat16")), "bf16": dict(cfg, torch_dtype="bfloat16")}
    for kind, c in dirs.items():
        os.makedirs(os.path.join(work, kind))
        with open(os.path.join(work, kind, "config.json"), "w") as f:
            json.dump(c, f)
    batch = prompts(args.gen, cfg["vocab_size"])
    res: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "args": vars(args), "engines": {}}
    graphs = {"disable_cuda_graph": False, "cuda_graph_max_bs_decode": args.gen} if args.cuda_graphs else {}
    runs = [(f"fp8_{b}", os.path.join(work, "fp8"), dict(SERVER_ARGS, fp8_gemm_runner_backend=b, **graphs), ckpt)
            for b in args.fp8_backends.split(",") if b.strip()]
    runs.append(("bf16", os.path.join(work, "bf16"), graphs, list(hf.items())))
    for name, model_dir, server_args, weights in runs:
        # a backend this machine lacks: reported, the others timed
        r = res["engines"][name] = guarded(run_engine, model_dir, server_args, weights, batch, args)
        if "error" not in r:
            print(f"{name}: tokens/s median {r['median']:.0f} (min {r['min']:.0f}, max {r['max']:.0f}, "
                  f"{args.reps} batches of {args.gen} x {args.new_tokens}); untimed first batch "
                  f"{r['warmup_tokens_per_s']:.0f}; engine start {r['engine_start_s']:.1f} s", flush=True)
    bf = res["engines"].get("bf16", {})
    for name, r in res["engines"].items():
        if name != "bf16" and "error" not in r and "error" not in bf:
            agree = sum(a == b for a, b in zip(r["first_tokens"], bf["first_tokens"])) / len(batch)
            r["over_bf16"] = r["median"] / bf["median"]
            r["first_token_agreement_with_bf16"] = agree
            print(f"{name} / bf16 tokens/s: {r['over_bf16']:.2f}x (medians); greedy first token equal {agree:.0%}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"gpu_fp8_decode_{args.model}{'_graphs' if args.cuda_graphs else ''}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all("error" not in r for r in res["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
