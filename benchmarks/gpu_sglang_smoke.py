"""GPU smoke test of mtrain's SGLang engine (one GPU, engine TP 1), checked against HF transformers.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_sglang_smoke.py      # writes $OUT/sglang_smoke.json
    python benchmarks/gpu_sglang_smoke.py --dry                                  # CPU: model dir + name mapping only

Steps: write a tiny random Llama HF dir (head_dim 64: SGLang needs a fused-rope head size); start SGLangEngine
with torchrun-like variables in the environment (they must not reach the schedulers, and must come back);
generate with logprobs and compare them with HF's log_softmax(logits / T) on the same tokens; push new weights
through update_weights + our direct loader (TP1 full tensors, HF->SGLang names mapped by the tiny table
below, which exists ONLY in this script); check get_weights_by_name and dump_params against what was pushed;
a bad bucket must raise EngineError and leave the engine working; release/resume memory, push again,
generate. Timings include a baseline measured in the same run: SGLang's own update_weights_from_tensor by
HF names (its load_weights path), against our direct path.
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import sys
import tempfile
import time

import torch

# Llama at TP1: SGLang fuses q/k/v and gate/up (llama.py:537-543); every other name is HF's.
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def hf_to_sglang_tp1(state: dict[str, torch.Tensor], num_layers: int) -> list[tuple[str, torch.Tensor]]:
    out, used = [], set()
    for i in range(num_layers):
        for dst, srcs in _FUSED.items():
            names = [f"model.layers.{i}.{s}" for s in srcs]
            out.append((f"model.layers.{i}.{dst}", torch.cat([state[n] for n in names], 0).contiguous()))
            used.update(names)
    out += [(n, t.contiguous()) for n, t in state.items() if n not in used]
    return out


def write_tiny_llama(path: str, seed: int) -> tuple[object, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["torch_dtype"] = c["dtype"] = "bfloat16"  # SGLang's ModelConfig reads either, depending on version
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, -1)
    return lp.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu()


def compare(model, reqs, comps, temperature) -> dict:
    diffs = torch.cat([(hf_logprobs(model, r.prompt_ids, c.output_ids, temperature)
                        - torch.tensor(c.logprobs)).abs() for r, c in zip(reqs, comps) if c.output_ids])
    return {"mean_abs": diffs.mean().item(), "max_abs": diffs.max().item(), "tokens": diffs.numel()}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def timed(fn, *a, **k):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn(*a, **k)
    torch.cuda.synchronize()
    return r, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="CPU: build the model dir and the name mapping only")
    ap.add_argument("--deterministic", action="store_true",
                    help="enable_deterministic_inference: per-request seeds make samples batch-independent")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(570, exit=True)  # a hang prints every thread's stack instead of nothing
    work = tempfile.mkdtemp(prefix="mtrain-smoke-")
    model_dir = os.path.join(work, "tiny-llama")
    hf0, state0 = write_tiny_llama(model_dir, seed=0)
    named0 = hf_to_sglang_tp1(state0, 2)
    if args.dry:
        print(f"dry: {len(state0)} HF tensors -> {len(named0)} SGLang tensors:",
              [(n, tuple(t.shape)) for n, t in named0[:4]])
        return 0

    from mtrain.rollout.protocol import EngineError, Request, SamplingParams
    from mtrain.rollout.sglang_engine import SGLangEngine
    from gpu_summary import reported  # this script's folder is on sys.path

    summary: dict = {"ok": False, "timings_s": {}, "checks": {}}
    T = summary["timings_s"]
    fake_torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "TORCHELASTIC_RUN_ID": "smoke"}
    os.environ.update(fake_torchrun)
    with reported(summary, "sglang_smoke.json") as engines:
        eng, T["engine_start"] = timed(SGLangEngine, model_dir, tp_size=1, mem_fraction_static=0.3,
                                       deterministic=args.deterministic, server_args={"dtype": "bfloat16"})
        engines.append(eng)
        summary["checks"]["torchrun_env_restored"] = all(os.environ.get(k) == v for k, v in fake_torchrun.items())
        hf0 = hf0.cuda().eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 2048, (16,), generator=g).tolist() for _ in range(8)]
        params = SamplingParams(max_new_tokens=32, temperature=1.0)
        reqs = [Request(f"s-{i}-", p, SamplingParams(max_new_tokens=32, temperature=1.0, seed=100 + i))
                for i, p in enumerate(prompts)]
        comps, T["generate_8x32"] = timed(eng.generate, reqs)
        assert [c.rid for c in comps] == [r.rid for r in reqs]
        assert all(c.weight_version == 0 for c in comps)
        # No stop ids: only the length limit stops (ignore_eos), whatever the model samples.
        assert all(len(c.output_ids) == 32 and c.finish_reason == "length" for c in comps)
        assert all(lp <= 1e-4 for c in comps for lp in c.logprobs)
        summary["checks"]["logprobs_vs_hf_v0"] = compare(hf0, reqs, comps, params.temperature)
        summary["checks"]["distinct_samples"] = len({tuple(c.output_ids) for c in comps})
        if args.deterministic:  # same seeds in a different batch: the same tokens
            again = eng.generate(reqs[2:5])
            summary["checks"]["batch_invariant"] = all(a.output_ids == c.output_ids
                                                       for a, c in zip(again, comps[2:5]))

        # New weights, pushed directly in two buckets; a baseline through SGLang's HF-name loader first.
        hf1, state1 = write_tiny_llama(os.path.join(work, "tiny-llama-v1"), seed=1)
        hf1 = hf1.cuda().eval()
        hf_named = [(n, t.cuda()) for n, t in state1.items()]
        _, T["baseline_hf_names_update"] = timed(eng.update_weights_hf_names, hf_named)
        named1 = [(n, t.cuda()) for n, t in hf_to_sglang_tp1(state1, 2)]
        half = len(named1) // 2
        _, T["direct_bucket_1"] = timed(eng.update_weights, [named1[:half]])
        _, T["direct_bucket_2"] = timed(eng.update_weights, [named1[half:]])
        _, T["finish_weight_update"] = timed(eng.finish_weight_update, 1)
        T["direct_total"] = T["direct_bucket_1"] + T["direct_bucket_2"] + T["finish_weight_update"]
        T["ratio_direct_over_baseline"] = T["direct_total"] / T["baseline_hf_names_update"]
        assert eng.weight_version == 1

        mismatched = []
        for n, t in named1:
            got = eng.get_weights_by_name(n, truncate_size=t.shape[0])
            if got is None or not torch.equal(torch.tensor(got, dtype=torch.float32), t.float().cpu()):
                mismatched.append(n)
        summary["checks"]["get_weights_by_name_mismatches"] = mismatched
        dump_dir = os.path.join(work, "dump")
        paths, T["dump_params_sha256"] = timed(eng.dump_params, dump_dir)
        with open(paths[0]) as f:
            dumped = json.load(f)
        summary["checks"]["dump_sha256_mismatches"] = [n for n, t in named1 if dumped[n]["sha256"] != sha(t)]
        ranks, T["sglang_check_weights"] = timed(eng.weight_checksums)
        summary["checks"]["sglang_checksum_params"] = len(ranks[0]["checksums"]) if ranks else 0

        comps1 = eng.generate(reqs)
        assert all(c.weight_version == 1 for c in comps1)
        summary["checks"]["logprobs_vs_hf_v1"] = compare(hf1, reqs, comps1, params.temperature)

        # A bad bucket: clear error, nothing written, engine still serves.
        bad = [("model.layers.0.self_attn.o_proj.weight", torch.zeros(256, 128, dtype=torch.bfloat16, device="cuda"))]
        try:
            eng.update_weights([bad])
            summary["checks"]["bad_bucket_error"] = "NOT RAISED"
        except EngineError as e:
            summary["checks"]["bad_bucket_error"] = str(e)[:300]
        assert eng.generate(reqs[:2])[0].output_ids

        # Colocated cycle: release all, resume weights, push, resume KV, generate.
        free0 = torch.cuda.mem_get_info()[0]
        _, T["release_weights_kv"] = timed(eng.release_memory, ("weights", "kv_cache"))
        free1 = torch.cuda.mem_get_info()[0]
        summary["checks"]["released_gib"] = (free1 - free0) / 2**30
        _, T["resume_weights"] = timed(eng.resume_memory, ("weights",))
        _, T["push_after_resume"] = timed(eng.update_weights, [named1])
        _, T["finish_after_resume"] = timed(eng.finish_weight_update, 2)
        _, T["resume_kv"] = timed(eng.resume_memory, ("kv_cache",))
        comps2 = eng.generate(reqs)
        assert all(c.weight_version == 2 for c in comps2)
        summary["checks"]["logprobs_vs_hf_after_resume"] = compare(hf1, reqs, comps2, params.temperature)

        c = summary["checks"]
        summary["ok"] = bool(
            c["torchrun_env_restored"] and not c["get_weights_by_name_mismatches"]
            and not c["dump_sha256_mismatches"] and "o_proj" in c["bad_bucket_error"]
            and c["logprobs_vs_hf_v0"]["mean_abs"] < 0.05 and c["logprobs_vs_hf_v1"]["mean_abs"] < 0.05
            and c["logprobs_vs_hf_after_resume"]["mean_abs"] < 0.05 and c["released_gib"] > 0
            and c.get("batch_invariant", True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":  # SGLang spawns its schedulers: the module must be importable without side effects
    sys.exit(main())
