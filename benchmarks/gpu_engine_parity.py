"""Rollout speed of mtrain's in-process SGLang engine against a standalone `sglang.Engine`, same requests.

    source benchmarks/gpu_setup.sh && python3 benchmarks/gpu_engine_parity.py --hf HF_DIR --out $OUT/parity.json

Both engines start with the same server arguments: what mtrain's engine gets from a run's config
(`rollout/sglang_wire.engine_server_args` plus `trainer/engines.production_server_args`: decode CUDA graphs captured
up to the largest batch, the attention backend mtrain picks), and the HF directory's real weights
(`load_format=auto`; a run syncs its own instead, which does not change the speed). The requests are the same too:
B prompts of 64 token ids drawn with a fixed seed, 128 new tokens each (no stop ids: ignore_eos, so every request
generates the full length), temperature 1, logprobs on, as the rollout asks. One engine lives at a time on the GPU.
The in-process engine is driven the way a run's rollout drives it: one `LocalClient.generate` (engine.submit) per
request, gathered on an asyncio loop of the caller's thread.

Rounds are interleaved (the default): both engines live on the GPU at once, the standalone one in a process of its
own (two SGLang engines in one process share process-wide state), and for each batch size the rounds alternate
in-process / standalone, the order swapped every round, so a drift of the machine (clocks, heat, a neighbour) reaches
both alike. Each engine is idle while the other runs. For each batch size (--batches) and engine: one warm-up, then
--repeats timed rounds; prints median and spread of generated tokens/s and the in-process / standalone ratio of the
medians (the issue's bar: >= 0.97). --sequential: one engine at a time, all of one engine's rounds first (the
former method).

Memory, interleaved: SGLang sizes an engine's KV cache from the memory free when it starts (free x
mem_fraction_static), so the standalone engine, started second, gets --standalone-fraction of what the first left.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
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


def start_inprocess(hf: str, extra: dict, mem_fraction: float):
    """(engine, one_round, start seconds): mtrain's engine, each round's requests submitted one by one through a
    LocalClient, as a run's rollout does (trainer/generation/rollouts.py)."""
    from mtrain.rollout.client import LocalClient
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.sglang_engine import SGLangEngine
    t0 = time.perf_counter()
    eng = SGLangEngine(hf, tp_size=1, mem_fraction_static=mem_fraction, load_format="auto", random_seed=0,
                       server_args=extra)
    start = time.perf_counter() - t0
    client = LocalClient(eng)

    def one_round(b: int, r: int, prompts: list[list[int]], new: int) -> list[int]:
        params = SamplingParams(max_new_tokens=new, temperature=1.0)
        reqs = [Request(rid=f"p{b}r{r}i{i:05d}", prompt_ids=p, params=params) for i, p in enumerate(prompts)]

        async def gather():
            return await asyncio.gather(*(client.generate(q) for q in reqs))
        return [len(c.output_ids) for c in asyncio.run(gather())]
    return eng, one_round, start


def run_inprocess(hf: str, extra: dict, batches: list[int], new: int, repeats: int, vocab: int) -> dict:
    eng, one_round, start = start_inprocess(hf, extra, 0.5)
    out = {"start_s": start}
    try:
        out.update(_timed_rounds(lambda b, r, prompts: one_round(b, r, prompts, new), batches, new, repeats, vocab))
    finally:
        eng.shutdown()
    return out


def start_standalone(hf: str, extra: dict, mem_fraction: float):
    """(engine, one_round, start seconds): a standalone sglang.Engine with the same server arguments, each round's
    requests in one `generate` call, a seed per request."""
    import sglang

    from mtrain.rollout.engine_env import engine_environment
    from mtrain.rollout.protocol import SamplingParams
    from mtrain.rollout.sglang_wire import engine_server_args, to_sglang_sampling
    kwargs = engine_server_args(hf, tp_size=1, mem_fraction_static=mem_fraction, base_gpu_id=0, load_format="auto",
                                random_seed=0, extra=extra)
    t0 = time.perf_counter()
    with engine_environment():
        eng = sglang.Engine(**kwargs)
    start = time.perf_counter() - t0
    seeds = random.Random(1)

    def one_round(prompts: list[list[int]], new: int) -> list[int]:
        params = SamplingParams(max_new_tokens=new, temperature=1.0)
        sp = [to_sglang_sampling(params, seeds.getrandbits(62)) for _ in prompts]
        return [len(d["output_ids"]) for d in eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)]
    return eng, one_round, start


def run_standalone(hf: str, extra: dict, batches: list[int], new: int, repeats: int, vocab: int, *,
                   mem_fraction: float = 0.5, prompt_len: int = 64) -> dict:
    eng, one_round, start = start_standalone(hf, extra, mem_fraction)
    out = {"start_s": start}
    try:
        out.update(_timed_rounds(lambda b, r, prompts: one_round(prompts, new), batches, new, repeats, vocab,
                                 prompt_len))
    finally:
        eng.shutdown()
    return out


class StandaloneWorker:
    """A standalone sglang.Engine in a process of its own, one round per command: the parent writes
    `{"b": B, "r": R, "new": N}` lines, the worker answers one `PARITY {...}` line each (its other output is SGLang's
    log, passed through)."""

    def __init__(self, hf: str, extra: dict, mem_fraction: float):
        cmd = [sys.executable, __file__, "--worker", "--hf", hf, "--worker-extra", json.dumps(extra),
               "--standalone-fraction", str(mem_fraction)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.start_s = self._answer()["start_s"]

    def _answer(self) -> dict:
        for line in self.p.stdout:
            if line.startswith("PARITY "):
                return json.loads(line[7:])
            print(line, end="", flush=True)
        raise SystemExit(f"the standalone engine's process ended (exit {self.p.wait()}) before answering")

    def round(self, b: int, r: int, new: int) -> list[int]:
        self.p.stdin.write(json.dumps({"b": b, "r": r, "new": new}) + "\n")
        self.p.stdin.flush()
        return self._answer()["lengths"]

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()


def worker(hf: str, extra: dict, mem_fraction: float) -> None:
    """The standalone engine's side of StandaloneWorker."""
    eng, one_round, start = start_standalone(hf, extra, mem_fraction)
    print("PARITY " + json.dumps({"start_s": start}), flush=True)
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    try:
        while line := sys.stdin.readline():  # "" once the parent closes the pipe
            cmd = json.loads(line)
            print("PARITY " + json.dumps({"lengths": one_round(_prompts(cmd["b"], vocab), cmd["new"])}), flush=True)
    finally:
        eng.shutdown()


def interleaved(args, extra: dict, batches: list[int], vocab: int) -> dict:
    """Both engines up; per batch size a warm-up each, then rounds alternating, the order swapped every round."""
    eng, inproc_round, start = start_inprocess(args.hf, extra, args.mem_fraction)
    res = {"inprocess": {"start_s": start}, "standalone": {}}
    alone = None
    try:
        alone = StandaloneWorker(args.hf, extra, args.standalone_fraction)
        res["standalone"]["start_s"] = alone.start_s
        for b in batches:
            prompts = _prompts(b, vocab)
            rounds = {"inprocess": [], "standalone": []}
            runs = {"inprocess": lambda r: inproc_round(b, r, prompts, args.new),
                    "standalone": lambda r: alone.round(b, r, args.new)}
            for r in range(args.repeats + 1):
                order = ("inprocess", "standalone") if r % 2 == 0 else ("standalone", "inprocess")
                for name in order:
                    t = time.perf_counter()
                    lengths = runs[name](r)
                    dt = time.perf_counter() - t
                    assert all(n == args.new for n in lengths), f"{name}: a request stopped before its length"
                    if r:  # round 0: the warm-up
                        rounds[name].append(dt)
                print(f"batch {b} round {r}: " + ", ".join(f"{k} {b * args.new / v[-1]:.0f} tok/s"
                                                           for k, v in rounds.items() if v and r), flush=True)
            for name in rounds:
                res[name][str(b)] = _rate(rounds[name], b * args.new)
    finally:
        if alone is not None:
            alone.close()
        eng.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--backend", default=None, help="attention backend (default: mtrain's choice)")
    ap.add_argument("--sequential", action="store_true", help="one engine at a time (the former method)")
    ap.add_argument("--mem-fraction", type=float, default=0.4, help="the in-process engine's (started first)")
    ap.add_argument("--standalone-fraction", type=float, default=0.7,
                    help="the standalone engine's, of the memory free when it starts (interleaved)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-extra", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.hf, json.loads(args.worker_extra), args.standalone_fraction)
        return
    batches = [int(b) for b in args.batches.split(",")]
    vocab = json.loads((Path(args.hf) / "config.json").read_text())["vocab_size"]
    extra = _server_args(args.hf, max(batches), not args.no_graphs, args.backend)
    print(f"server args beyond mtrain's wire defaults: {extra}", flush=True)
    res = {"extra": extra, "new_tokens": args.new, "method": "sequential" if args.sequential else "interleaved"}
    if args.sequential:
        res["inprocess"] = run_inprocess(args.hf, extra, batches, args.new, args.repeats, vocab)
        res["standalone"] = run_standalone(args.hf, extra, batches, args.new, args.repeats, vocab)
    else:
        res.update(interleaved(args, extra, batches, vocab))
    for b in batches:
        a, s = res["inprocess"][str(b)], res["standalone"][str(b)]
        res[f"ratio_{b}"] = a["median_tok_s"] / s["median_tok_s"]
        # the ratio of each interleaved pair too: its spread says how much of the medians' ratio is noise
        pairs = [sr / ar for ar, sr in zip(a["rounds_s"], s["rounds_s"])]
        res[f"pair_ratios_{b}"] = pairs
        print(f"batch {b} x {args.new}: in-process {a['median_tok_s']:.0f} tok/s ({a['min_tok_s']:.0f}-"
              f"{a['max_tok_s']:.0f}), standalone {s['median_tok_s']:.0f} ({s['min_tok_s']:.0f}-"
              f"{s['max_tok_s']:.0f}): ratio {res[f'ratio_{b}']:.3f}; per round {min(pairs):.3f}-{max(pairs):.3f}",
              flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
