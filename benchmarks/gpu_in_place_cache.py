"""After an update in place, does a new request on a cached prompt get the new weights? (one GPU, SGLang engine TP 1)

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_in_place_cache.py     # writes $OUT/in_place_cache.json

An update in place (rollout.async=stream) finishes with flush_cache=False, so SGLang's radix cache keeps prefixes the
old weights computed. mtrain namespaces the cache key by the weight version a request starts on
(SGLangRequests._versioned_generate). This script checks it end to end on a tiny random Llama:
  1. weights A; a long prompt P generated once (its prefix enters the cache), then again (cached_tokens > 0: sharing
     within a version is kept);
  2. pause_in_place, push weights B, continue (no flush);
  3. a new greedy request on P: its logprobs against HF's model B run by this script (a fresh computation) and
     against the same engine after flush_cache (a fresh prefill on B); cached_tokens of that request;
  4. the same request with the namespace removed (SGLang's plain Engine.async_generate, the former behaviour), after
     re-caching P on A and updating in place again: what it gets (the stale-KV error the namespace prevents).
Timings: a generate of 8 cached-prefix requests with and without the namespace in one version (the namespace costs
nothing within a version; its only cost is no reuse across versions, which was wrong reuse).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def raw_generate(eng, prompt: list[int], namespaced: bool, max_new: int = 8) -> dict:
    """One greedy request through the engine's own request path (namespaced) or SGLang's Engine.async_generate
    (not), returning SGLang's output dict (meta_info carries cached_tokens)."""
    from mtrain.rollout.protocol import SamplingParams
    from mtrain.rollout.sglang_wire import to_sglang_sampling

    kwargs = dict(input_ids=list(prompt), sampling_params=to_sglang_sampling(SamplingParams(max_new_tokens=max_new,
                                                                                             temperature=0.0), 0),
                  return_logprob=True)
    coro = eng._versioned_generate(kwargs, stream=False) if namespaced else eng._engine.async_generate(**kwargs)
    return eng._run(coro, "raw_generate")


def logprobs_of(out: dict) -> list[float]:
    return [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]


def tokens_of(out: dict) -> list[int]:
    return [int(x[1]) for x in out["meta_info"]["output_token_logprobs"]]


def hf_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu().tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def push(eng, named, version: int) -> None:
    eng.pause_in_place()
    eng.update_weights([named])
    eng.finish_weight_update(version)
    eng.continue_generation()


def main() -> int:
    faulthandler.dump_traceback_later(570, exit=True)
    from gpu_sglang_smoke import hf_to_sglang_tp1, write_tiny_llama
    from gpu_summary import reported
    from mtrain.rollout.sglang_engine import SGLangEngine

    work = tempfile.mkdtemp(prefix="mtrain-inplace-")
    _, state_a = write_tiny_llama(os.path.join(work, "a"), seed=0)
    hf_b, state_b = write_tiny_llama(os.path.join(work, "b"), seed=1)
    hf_b = hf_b.cuda().eval()
    named_a = [(n, t.cuda()) for n, t in hf_to_sglang_tp1(state_a, 2)]
    named_b = [(n, t.cuda()) for n, t in hf_to_sglang_tp1(state_b, 2)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 2048, (512,), generator=g).tolist()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29541"})
    summary: dict = {"ok": False, "checks": {}, "timings_s": {}}
    C, T = summary["checks"], summary["timings_s"]
    with reported(summary, "in_place_cache.json") as engines:
        eng = SGLangEngine(os.path.join(work, "a"), tp_size=1, mem_fraction_static=0.3,
                           server_args={"dtype": "bfloat16"})
        engines.append(eng)
        raw_generate(eng, prompt, True)
        C["v0_second_request_cached_tokens"] = raw_generate(eng, prompt, True)["meta_info"].get("cached_tokens")

        push(eng, named_b, 1)
        after = raw_generate(eng, prompt, True)
        C["after_update_cached_tokens"] = after["meta_info"].get("cached_tokens")
        C["after_update_vs_hf_b_max_abs"] = max_gap(logprobs_of(after), hf_logprobs(hf_b, prompt, tokens_of(after)))
        eng.flush_cache()
        fresh = raw_generate(eng, prompt, True)
        C["same_tokens_as_fresh_prefill"] = tokens_of(fresh) == tokens_of(after)
        C["after_update_vs_fresh_prefill_max_abs"] = max_gap(logprobs_of(after), logprobs_of(fresh))
        C["fresh_prefill_vs_hf_b_max_abs"] = max_gap(logprobs_of(fresh), hf_logprobs(hf_b, prompt, tokens_of(fresh)))

        # The former behaviour: no namespace. Cache P on weights A (plain key), update in place to B, ask again.
        push(eng, named_a, 2)
        raw_generate(eng, prompt, False)
        push(eng, named_b, 3)
        stale = raw_generate(eng, prompt, False)
        C["unnamespaced_after_update_cached_tokens"] = stale["meta_info"].get("cached_tokens")
        C["unnamespaced_after_update_vs_hf_b_max_abs"] = max_gap(logprobs_of(stale),
                                                                 hf_logprobs(hf_b, prompt, tokens_of(stale)))

        # Cost within one version: 8 requests sharing P, namespaced vs not (3 repeats each, same engine).
        for label, ns in (("namespaced", True), ("plain", False)):
            runs = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(8):
                    raw_generate(eng, prompt, ns)
                runs.append(time.perf_counter() - t0)
            T[f"8_cached_requests_{label}"] = runs
        summary["ok"] = (C["after_update_cached_tokens"] == 0 and C["same_tokens_as_fresh_prefill"]
                         and C["after_update_vs_fresh_prefill_max_abs"] == 0.0)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
