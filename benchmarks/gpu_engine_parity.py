"""Rollout speed of mtrain's in-process SGLang engine against a standalone `sglang.Engine`, same requests.

    source benchmarks/gpu_setup.sh && python3 benchmarks/gpu_engine_parity.py --hf HF_DIR --out $OUT/parity.json

Both engines start with the same server arguments: what mtrain's engine gets from a run's config
(`rollout/sglang_wire.engine_server_args` plus `trainer/engines.production_server_args`: decode CUDA graphs captured
up to the largest batch, the attention backend mtrain picks), and the HF directory's real weights
(`load_format=auto`; a run syncs its own instead, which does not change the speed). The requests are the same too:
B prompts of 64 token ids drawn with a fixed seed, 128 new tokens each (no stop ids: ignore_eos, so every request
generates the full length), temperature 1, logprobs on, as the rollout asks. One engine lives at a time on the GPU.
For each batch size (--batches) and engine: one warm-up, then --repeats timed rounds; prints median and spread
of generated tokens/s and the in-process / standalone ratio of the medians (the issue's bar: >= 0.97).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _prompts(n: int, vocab: int, length: int = 64) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _server_args(hf: str, max_bs: int, graphs: bool, backend: str | None) -> dict:
    from mtrain.config import load_config
    from mtrain.trainer.engines import production_server_args
    overrides = [f"model.hf_path={hf}", "data.task=arithmetic", f"engine.cuda_graph_max_bs={max_bs}",
                 f"engine.cuda_graphs={str(graphs).lower()}", "model.dtype=bfloat16"]
    if backend:
        overrides.append(f"engine.attention_backend={backend}")
    return {"dtype": "bfloat16", **production_server_args(load_config(None, overrides))}


def _rate(rounds: list[float], tokens: int) -> dict:
    rates = [tokens / t for t in rounds]
    return {"median_tok_s": statistics.median(rates), "min_tok_s": min(rates), "max_tok_s": max(rates),
            "rounds_s": rounds}


def _timed_rounds(one_round, batches: list[int], new: int, repeats: int, vocab: int, prompt_len: int = 64) -> dict:
    """For each batch size: one warm-up round, then `repeats` timed ones; every request must generate `new` tokens."""
    out = {}
    for b in batches:
        prompts = _prompts(b, vocab, prompt_len)
        rounds = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            lengths = one_round(b, r, prompts)
            dt = time.perf_counter() - t
            assert all(n == new for n in lengths), "a request stopped before its length"
            if r:
                rounds.append(dt)
        out[str(b)] = _rate(rounds, b * new)
    return out


def run_inprocess(hf: str, extra: dict, batches: list[int], new: int, repeats: int, vocab: int) -> dict:
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.sglang_engine import SGLangEngine
    t0 = time.perf_counter()
    eng = SGLangEngine(hf, tp_size=1, mem_fraction_static=0.5, load_format="auto", random_seed=0, server_args=extra)
    out = {"start_s": time.perf_counter() - t0}
    params = SamplingParams(max_new_tokens=new, temperature=1.0)

    def one_round(b: int, r: int, prompts: list[list[int]]) -> list[int]:
        reqs = [Request(rid=f"p{b}r{r}i{i:05d}", prompt_ids=p, params=params) for i, p in enumerate(prompts)]
        return [len(c.output_ids) for c in eng.generate(reqs)]
    try:
        out.update(_timed_rounds(one_round, batches, new, repeats, vocab))
    finally:
        eng.shutdown()
    return out


def run_standalone(hf: str, extra: dict, batches: list[int], new: int, repeats: int, vocab: int, *,
                   mem_fraction: float = 0.5, prompt_len: int = 64) -> dict:
    import sglang

    from mtrain.rollout.engine_env import engine_environment
    from mtrain.rollout.sglang_wire import engine_server_args, to_sglang_sampling
    from mtrain.rollout.protocol import SamplingParams
    kwargs = engine_server_args(hf, tp_size=1, mem_fraction_static=mem_fraction, base_gpu_id=0, load_format="auto",
                                random_seed=0, extra=extra)
    t0 = time.perf_counter()
    with engine_environment():
        eng = sglang.Engine(**kwargs)
    out = {"start_s": time.perf_counter() - t0}
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    seeds = random.Random(1)

    def one_round(b: int, r: int, prompts: list[list[int]]) -> list[int]:
        sp = [to_sglang_sampling(params, seeds.getrandbits(62)) for _ in prompts]
        return [len(d["output_ids"]) for d in eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)]
    try:
        out.update(_timed_rounds(one_round, batches, new, repeats, vocab, prompt_len))
    finally:
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--backend", default=None, help="attention backend (default: mtrain's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    vocab = json.loads((Path(args.hf) / "config.json").read_text())["vocab_size"]
    extra = _server_args(args.hf, max(batches), not args.no_graphs, args.backend)
    print(f"server args beyond mtrain's wire defaults: {extra}", flush=True)
    res = {"extra": extra, "new_tokens": args.new}
    res["inprocess"] = run_inprocess(args.hf, extra, batches, args.new, args.repeats, vocab)
    res["standalone"] = run_standalone(args.hf, extra, batches, args.new, args.repeats, vocab)
    for b in batches:
        a, s = res["inprocess"][str(b)], res["standalone"][str(b)]
        res[f"ratio_{b}"] = a["median_tok_s"] / s["median_tok_s"]
        print(f"batch {b} x {args.new}: in-process {a['median_tok_s']:.0f} tok/s ({a['min_tok_s']:.0f}-"
              f"{a['max_tok_s']:.0f}), standalone {s['median_tok_s']:.0f} ({s['min_tok_s']:.0f}-"
              f"{s['max_tok_s']:.0f}): ratio {res[f'ratio_{b}']:.3f}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
