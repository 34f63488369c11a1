"""FP8 rollout from bf16 training on one GPU: bf16 Megatron weights -> SGLang's block-FP8 parameters through the
resharding kernel (quantization fused into the scatter), pull and push, checked bit for bit and timed.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_fp8_sync.py --model dsv3tiny --disk
    python benchmarks/gpu_fp8_sync.py --model llama8b --contiguous-params
    python benchmarks/gpu_fp8_sync.py --model qwen3moe12l --contiguous-params

1. A Megatron-core GPTModel (bf16, random init) on the GPU: the trainer.
2. The offline FP8 checkpoint of the same weights: Megatron -> HF tensors (our planner), every linear weight
   block-quantized on its own with `mtrain.kernels.quantize_blocks` (scale = amax/448 per 128x128 block; the CPU
   tests hold it bit-equal to a float64 reference), stored as `weight` + `weight_scale_inv` like DeepSeek's
   release. With --disk it is written as safetensors + an FP8 config.json and the FP8 engine loads it at start;
   otherwise the engine starts with dummy weights and SGLang's own loader is fed the same tensors by HF names
   (update_weights_from_tensor, one call). Either way SGLang's loader fuses and slices them: the reference is
   then every engine parameter's sha256 (weights, scales, bf16 ones; our dump_params loader, dtype-exact).
3. The FP8 engine (quantization fp8, triton FP8 GEMMs): pull sync and push sync through the trainer's own
   WeightSync (engine_fp8), timed; then for each mode: garble (trainer weights x -2: every FP8 value flips sign,
   every scale doubles), sync, restore (x -0.5, exact in bf16), sync, and compare every parameter's sha256 with
   the reference. Generate greedily (it runs; tokens/s).
4. The same model in a bf16 engine: pull sync timed (the baseline of the same run), generate the same prompts:
   tokens/s, greedy first-token agreement and logprob gap FP8 vs bf16.
Copy floors from the copy bandwidth measured in this run: bf16 sync reads and writes 2 bytes per weight, FP8
sync reads 2 and writes 1 (+ 4 per 128x128 block). Prints a summary; writes $OUT/gpu_fp8_sync_<model>.json;
exit 1 if any parameter differs.
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
from bench_sync import CONFIGS, contiguous_params, copy_bandwidth, timed  # noqa: E402


def fp8_checkpoint(hf: dict[str, torch.Tensor], layout) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the FP8 checkpoint: linear weights as fp8 + weight_scale_inv, the rest as they are."""
    from mtrain.kernels import quantize_blocks
    from mtrain.layouts.fp8 import BLOCK, SCALE_SUFFIX

    linear = {p.name for w in layout.weights if w.block_fp8 and w.sglang for p in w.hf}
    out = []
    for name, t in hf.items():
        if name in linear:
            q, s = quantize_blocks(t, BLOCK)
            out += [(name, q), (name + SCALE_SUFFIX, s)]
        else:
            out.append((name, t))
    return out


def sha_dump(eng, tag: str) -> dict[str, dict]:
    d = tempfile.mkdtemp(prefix=f"mtrain-fp8-{tag}-")
    (path,) = eng.dump_params(d)
    with open(path) as f:
        return json.load(f)


def scale_params(chunks, factor: float) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.mul_(factor)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(n)]


def generate(eng, batch: list[list[int]], new_tokens: int):
    from mtrain.rollout.protocol import Request, SamplingParams

    reqs = [Request(rid=f"r{i}", prompt_ids=p, params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
            for i, p in enumerate(batch)]
    eng.generate(reqs[:2])  # warm-up (Triton JIT of the attention/MoE/FP8 kernels)
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    dt = time.perf_counter() - t0
    return out, sum(len(c.output_ids) for c in out) / dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dsv3tiny")
    ap.add_argument("--bucket-mb", type=int, default=512, help="push-mode bucket size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk", action="store_true", help="reference = SGLang loading the FP8 checkpoint from disk")
    ap.add_argument("--contiguous-params", action="store_true", help="Megatron params in one buffer per dtype")
    ap.add_argument("--gen", type=int, default=64, help="prompts per generate batch")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models.builder import build_model
    from mtrain.reshard.local import reshard_in_memory
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.rollout.fp8_engine import SERVER_ARGS, fp8_config
    from mtrain.rollout.sglang_engine import SGLangEngine
    from mtrain.rollout.groups import EngineGroups
    from mtrain.trainer.sync import WeightSync

    cfg = CONFIGS[args.model]
    res: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "args": vars(args)}
    init_distributed()
    chunks, _ = build_model(cfg, params_dtype=torch.bfloat16)
    if args.contiguous_params:
        contiguous_params(chunks)
    layout = model_layout(cfg)
    lookup = tensor_lookup(chunks)
    hf_plan = build_plan(layout, MegatronLayout(), HFLayout())
    hf = {k[2]: v for k, v in reshard_in_memory(hf_plan, lookup, dtype=torch.bfloat16, backend="triton",
                                                device="cuda").items()}
    ckpt = fp8_checkpoint(hf, layout)
    n_bf16 = sum(t.numel() * 2 for t in hf.values())
    n_fp8 = sum(t.numel() * t.element_size() for _, t in ckpt)
    quantized = sum(t.numel() for n, t in ckpt if t.dtype == torch.float8_e4m3fn)
    del hf
    bw = copy_bandwidth()
    res.update(copy_GBps=bw / 1e9, bf16_bytes=n_bf16, fp8_engine_bytes=n_fp8, fp8_params=quantized,
               bf16_floor_s=2 * n_bf16 / bw, fp8_floor_s=(n_bf16 + n_fp8) / bw)

    work = tempfile.mkdtemp(prefix="mtrain-fp8-sync-")
    fp8_dir, bf16_dir = os.path.join(work, "fp8"), os.path.join(work, "bf16")
    for d, c in ((fp8_dir, fp8_config(dict(cfg, torch_dtype="bfloat16"))), (bf16_dir, dict(cfg, torch_dtype="bfloat16"))):
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
    if args.disk:
        from mtrain.converters.safetensors_io import ShardedWriter
        with ShardedWriter(fp8_dir + ".st", max_shard_bytes=4 << 30) as w:
            for n, t in ckpt:
                w.add(n, t.cpu())
            w.commit()
        for fn in os.listdir(fp8_dir + ".st"):
            os.replace(os.path.join(fp8_dir + ".st", fn), os.path.join(fp8_dir, fn))

    # ---- FP8 engine
    t0 = time.perf_counter()
    eng = SGLangEngine(fp8_dir, tp_size=1, mem_fraction_static=0.35, load_format="auto" if args.disk else "dummy",
                       server_args={"dtype": "bfloat16", **SERVER_ARGS})
    res["fp8_engine_start_s"] = time.perf_counter() - t0
    if not args.disk:
        eng.update_weights_hf_names(ckpt)  # SGLang's own loader
    reference = sha_dump(eng, "ref")
    res["params_checked"] = len(reference)
    res["fp8_params_in_engine"] = sum(v["dtype"] == "float8_e4m3fn" for v in reference.values())
    del ckpt
    torch.cuda.empty_cache()

    def weight_sync(mode: str, fp8: bool, engine):
        return WeightSync(layout, chunks, engine, groups=EngineGroups(1, 1, 1), engine_kind="sglang",
                          dtype=torch.bfloat16, bucket_bytes=args.bucket_mb << 20, backend="triton", device="cuda", mode=mode, engine_fp8=fp8)

    version = [0]

    def run(ws):
        version[0] += 1
        ws.sync(version[0])

    syncs = {m: weight_sync(m, True, eng) for m in ("pull", "push")}
    for mode, ws in syncs.items():
        res[f"fp8_{mode}_first_s"] = timed(lambda: run(ws), 1)[0]
        res[f"fp8_{mode}_s_runs"] = timed(lambda: run(ws), args.repeats)  # every run kept: the spread is reported
        res[f"fp8_{mode}_s"] = statistics.median(res[f"fp8_{mode}_s_runs"])
        scale_params(chunks, -2.0)
        run(ws)
        res[f"fp8_{mode}_params_changed_by_garble"] = sum(
            v["sha256"] != reference[k]["sha256"] for k, v in sha_dump(eng, "garbled").items())
        scale_params(chunks, -0.5)
        run(ws)
        after = sha_dump(eng, mode)
        res[f"fp8_{mode}_mismatched"] = sorted(k for k in reference if after.get(k, {}).get("sha256")
                                               != reference[k]["sha256"])
    batch = prompts(args.gen, cfg["vocab_size"])
    fp8_out, res["fp8_tokens_per_s"] = generate(eng, batch, args.new_tokens)
    res["fp8_generated_tokens"] = sum(len(c.output_ids) for c in fp8_out)
    eng.shutdown()
    del eng, syncs
    torch.cuda.empty_cache()

    # ---- bf16 engine, same run: the baseline
    t0 = time.perf_counter()
    eng = SGLangEngine(bf16_dir, tp_size=1, mem_fraction_static=0.35, load_format="dummy",
                       server_args={"dtype": "bfloat16"})
    res["bf16_engine_start_s"] = time.perf_counter() - t0
    pull = weight_sync("pull", False, eng)
    res["bf16_pull_first_s"] = timed(lambda: run(pull), 1)[0]
    res["bf16_pull_s_runs"] = timed(lambda: run(pull), args.repeats)
    res["bf16_pull_s"] = statistics.median(res["bf16_pull_s_runs"])
    bf16_out, res["bf16_tokens_per_s"] = generate(eng, batch, args.new_tokens)
    eng.shutdown()
    same = [(a, b) for a, b in zip(fp8_out, bf16_out) if a.output_ids and b.output_ids
            and a.output_ids[0] == b.output_ids[0]]
    res["first_token_agreement"] = len(same) / max(1, len(batch))
    res["first_token_logprob_gap_mean"] = (statistics.mean(abs(a.logprobs[0] - b.logprobs[0]) for a, b in same)
                                           if same else None)

    ok = not (res["fp8_pull_mismatched"] or res["fp8_push_mismatched"])
    print(f"\n{args.model}: {quantized / 1e9:.2f} G FP8 weights, {res['fp8_params_in_engine']} FP8 params of "
          f"{res['params_checked']}; copy {bw / 1e9:.0f} GB/s")
    print(f"sync ms: FP8 pull {res['fp8_pull_s'] * 1e3:.1f} (floor {res['fp8_floor_s'] * 1e3:.1f}, "
          f"{res['fp8_pull_s'] / res['fp8_floor_s']:.2f}x) | FP8 push {res['fp8_push_s'] * 1e3:.1f} | "
          f"bf16 pull {res['bf16_pull_s'] * 1e3:.1f} (floor {res['bf16_floor_s'] * 1e3:.1f}, "
          f"{res['bf16_pull_s'] / res['bf16_floor_s']:.2f}x) | FP8/bf16 pull {res['fp8_pull_s'] / res['bf16_pull_s']:.2f}x")
    for mode in ("pull", "push"):
        print(f"FP8 {mode}: bit-equal to SGLang's load of the FP8 checkpoint: {not res[f'fp8_{mode}_mismatched']} "
              f"({res['params_checked']} params; {res[f'fp8_{mode}_params_changed_by_garble']} changed by the garble)")
    print(f"generate: FP8 {res['fp8_tokens_per_s']:.0f} tok/s, bf16 {res['bf16_tokens_per_s']:.0f} tok/s; greedy "
          f"first token equal {res['first_token_agreement']:.0%}, |logprob gap| {res['first_token_logprob_gap_mean']}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"gpu_fp8_sync_{args.model}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
