"""Load test of the OpenAI front on loopback, and its overhead against calling the engine directly.

    python benchmarks/bench_front.py --engine reference                        # CPU (2 cores: keep --clients low)
    source benchmarks/gpu_setup.sh && python benchmarks/bench_front.py         # SGLang on one GPU

Three phases of `--duration` seconds each, on the same engine, same prompts, same token budget:
  direct: `--clients` concurrent tasks calling `LocalClient(engine).generate` in a loop (the baseline);
  front:  `--clients` concurrent official `openai.AsyncOpenAI` clients, each with its own recorded session, calling
          /sessions/{id}/v1/chat/completions in a loop (ChatML template rendered on our side, SSE off), once with
          the clients in a process of their own and once inside the server's process (sharing its interpreter).
Reported: requests served, requests/s, generated tokens/s, p50/p99 latency per phase, and front/direct ratios.
Checked after the front phase: every client's calls are in its own session (count and content), none lost or mixed.
Streaming check (first, always; `--stream-only` runs just it): the engine's streamed deltas (`Request.on_tokens`
through `client.stream`) concatenate to exactly its Completion, arrive in more than one piece (time of the first
delta vs the completion reported), an abort after 3 deltas keeps the contract; through the front, a streamed greedy
chat gives the same text as the non-streamed one (reported, not asserted: SGLang is not batch-invariant).
The tiny random Llama (head_dim 64 for SGLang's rope) has a real HF fast tokenizer's vocabulary (tests/serve).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(name: str, lat: list[float], tokens: int, seconds: float) -> dict:
    return {"phase": name, "requests": len(lat), "req_per_s": len(lat) / seconds, "tokens_per_s": tokens / seconds,
            "p50_ms": 1e3 * pct(lat, 0.5), "p99_ms": 1e3 * pct(lat, 0.99)}


async def direct_phase(client, prompt, clients, duration, max_tokens, stops):
    from mtrain.rollout.protocol import Request, SamplingParams
    lat, tokens, end = [], [0], time.perf_counter() + duration

    async def worker(k):
        i = 0
        while time.perf_counter() < end:
            t = time.perf_counter()
            c = await client.generate(Request(f"direct-{k}-{i}-", prompt, SamplingParams(
                max_new_tokens=max_tokens, stop_token_ids=stops, seed=k * 100000 + i)))
            lat.append(time.perf_counter() - t)
            tokens[0] += len(c.output_ids)
            i += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    return summary("direct", lat, tokens[0], time.perf_counter() - t0)


async def front_clients(url, api_key, model, messages, clients, duration, max_tokens):
    """The front phase's clients: official AsyncOpenAI clients, each in its own session (POST /sessions)."""
    import httpx
    from openai import AsyncOpenAI
    lat, tokens, end, calls = [], [0], time.perf_counter() + duration, {}

    async def worker(k):
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{url}/sessions", headers={"Authorization": f"Bearer {api_key}"})
            sid = r.json()["id"]
        c = AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key=api_key, max_retries=0)
        msgs = [dict(messages[0], content=f"{messages[0]['content']} [client {k}]")] + messages[1:]
        n = 0
        while time.perf_counter() < end:
            t = time.perf_counter()
            r = await c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, seed=k * 100000 + n)
            lat.append(time.perf_counter() - t)
            tokens[0] += r.usage.completion_tokens
            n += 1
        await c.close()
        calls[k] = (sid, n)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    return lat, tokens[0], time.perf_counter() - t0, calls


def clients_process(*args):
    return asyncio.run(front_clients(*args))


def front_phase(server, model, messages, clients, duration, max_tokens, separate: bool):
    """separate: the clients run in a process of their own (the front's cost without the clients' Python in the
    server's process); otherwise in this process, sharing its interpreter with the server and the engine."""
    args = (server.url, server.api_key, model, messages, clients, duration, max_tokens)
    if separate:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            lat, tokens, seconds, calls = ex.submit(clients_process, *args).result()
    else:
        lat, tokens, seconds, calls = clients_process(*args)
    out = summary("front" + (" (clients in another process)" if separate else " (clients in-process)"), lat, tokens,
                  seconds)
    lost = mixed = 0
    for k, (sid, n) in calls.items():
        s = server.front.sessions.get(sid)
        lost += abs(s.calls - n) + abs(len(s.branches) - n)
        mixed += sum(f"[client {k}]" not in b.messages[0]["content"] for b in s.branches)
    out.update(lost_calls=lost, mixed_calls=mixed)
    return out


async def stream_check(client, prompt, stops, base_url, api_key, model, messages) -> dict:
    from openai import AsyncOpenAI

    from mtrain.rollout.client import stream
    from mtrain.rollout.protocol import Completion, Request, SamplingParams

    async def run(rid, max_new, abort_after=None):
        t0, first, deltas = time.perf_counter(), None, []
        req = Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stops))
        async for item in stream(client, req):
            if isinstance(item, Completion):
                ids = [t for d in deltas for t in d.output_ids]
                lps = [x for d in deltas for x in d.logprobs]
                if (ids, lps) != (item.output_ids, item.logprobs):
                    raise SystemExit(f"stream {rid}: deltas {ids[:8]}... are not the completion "
                                     f"{item.output_ids[:8]}...")
                return {"deltas": len(deltas), "tokens": len(ids), "finish": item.finish_reason,
                        "first_delta_s": first, "completion_s": time.perf_counter() - t0}
            first = first if first is not None else time.perf_counter() - t0
            deltas.append(item)
            if abort_after is not None and len(deltas) == abort_after:
                client.abort(rid)

    out = {"engine": await run("stream-check-a", 64), "aborted": await run("stream-check-b", 512, abort_after=3)}
    if out["engine"]["tokens"] > 1 and out["engine"]["deltas"] < 2:
        raise SystemExit(f"the engine streamed {out['engine']['tokens']} tokens in one piece: {out['engine']}")
    if out["aborted"]["finish"] != "abort":
        raise SystemExit(f"an abort after 3 deltas did not abort: {out['aborted']}")
    c = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    kw = dict(model=model, messages=messages, max_tokens=128, temperature=0, seed=1)
    t0 = time.perf_counter()
    full = (await c.chat.completions.create(**kw)).choices[0].message.content
    whole_s = time.perf_counter() - t0
    t0, first, pieces = time.perf_counter(), None, []
    async for chunk in await c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.delta.content and first is None:
                first = time.perf_counter() - t0
            pieces.append(ch.delta.content or "")
    out["front"] = {"chunks_with_text": sum(bool(p) for p in pieces), "first_text_chunk_s": first,
                    "stream_total_s": time.perf_counter() - t0, "non_streamed_s": whole_s,
                    "same_text_as_non_streamed": "".join(pieces) == full}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "reference"], default="sglang")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stream-only", action="store_true", help="run only the streaming check")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_front.json"))
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from front_fixtures import chatml_tokenizer
    from mtrain.rollout.agents import tito
    from mtrain.rollout.client import LocalClient
    from mtrain.rollout.reference_engine import as_hf_config
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer

    tok = chatml_tokenizer()
    cfg = dict(model_type="llama", vocab_size=len(tok), hidden_size=256, intermediate_size=512,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=1024, initializer_range=0.05, tie_word_embeddings=False,
               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf_dir = tempfile.mkdtemp(prefix="mtrain-bench-front-")
    AutoModelForCausalLM.from_config(as_hf_config(cfg)).to(torch.bfloat16).save_pretrained(hf_dir)
    if a.engine == "sglang":
        from mtrain.rollout.sglang_engine import SGLangEngine
        engine = SGLangEngine(hf_dir, tp_size=1, mem_fraction_static=0.3, random_seed=0,
                              server_args={"dtype": "bfloat16"})
    else:
        from mtrain.rollout import ReferenceEngine
        engine = ReferenceEngine.from_pretrained(hf_dir, dtype=torch.float32)
    client = LocalClient(engine)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten."}]
    _, prompt = tito.prompt_ids(tok, messages, None)
    front = OpenAIFront(client, tok, model_name="bench", max_positions=1024)
    report = {"engine": a.engine, "clients": a.clients, "duration_s": a.duration, "max_tokens": a.max_tokens,
              "prompt_tokens": len(prompt)}
    with FrontServer(front, max_concurrency=max(256, 2 * a.clients)) as server:
        report["streaming"] = asyncio.run(stream_check(client, prompt, (tok.eos_token_id,), server.base_url,
                                                       server.api_key, "bench", messages))
        print(json.dumps(report["streaming"], indent=2))
        if a.stream_only:
            engine.shutdown()
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(report, indent=2))
            return
        asyncio.run(direct_phase(client, prompt, min(a.clients, 4), 2.0, a.max_tokens, (tok.eos_token_id,)))  # warm
        d = asyncio.run(direct_phase(client, prompt, a.clients, a.duration, a.max_tokens, (tok.eos_token_id,)))
        fs = [front_phase(server, "bench", messages, a.clients, a.duration, a.max_tokens, separate)
              for separate in (True, False)]
    engine.shutdown()
    report.update(direct=d, front=fs)
    for f, key in zip(fs, ("separate", "inprocess")):
        report[f"ratio_{key}"] = {"req_per_s": f["req_per_s"] / d["req_per_s"],
                                  "tokens_per_s": f["tokens_per_s"] / d["tokens_per_s"],
                                  "p50": f["p50_ms"] / d["p50_ms"], "p99": f["p99_ms"] / d["p99_ms"]}
    print(json.dumps(report, indent=2))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    bad = [(f["lost_calls"], f["mixed_calls"]) for f in fs if f["lost_calls"] or f["mixed_calls"]]
    if bad:
        raise SystemExit(f"sessions lost or mixed calls (lost, mixed): {bad}")


if __name__ == "__main__":
    main()
