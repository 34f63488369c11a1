"""Full-model weight sync on one GPU: mtrain's direct path vs SGLang's HF-names path, same run, same model.

    source benchmarks/gpu_setup.sh && python benchmarks/bench_sync.py --model llama8b

1. Builds a Megatron-core GPTModel (bf16, random init) on the GPU: the training side.
2. Converts it to HF tensors (our planner, on the GPU) and, with --disk, writes them as a HF checkpoint; an
   SGLang engine loads it from disk. Its parameters' checksums (SGLang's own `check_weights`) are the
   reference. Without --disk the engine starts with dummy weights and the reference is SGLang's own loader
   fed the HF tensors (`model.load_weights`, the function its disk loader calls).
3. Times, for each bucket size: the HF-names path (`update_weights_from_tensor` with HF-named tensors already
   on the GPU; SGLang's loader fuses and slices) and mtrain's push mode (Megatron params -> our kernel packs
   SGLang's per-rank layout into a bucket -> our custom loader copies it into the parameters); then mtrain's
   pull mode (the engine's loader runs our kernel from the Megatron params, read in place through CUDA IPC,
   straight into its parameters). Both through the trainer's own `WeightSync`. Also the Megatron->HF
   conversion a peer pays on top of its HF-names call, and the copy floor measured in this run.
4. Per mode: garbles the engine's weights (SGLang's check_weights "reset_tensors": random values), syncs, and
   checks every parameter's checksum equals the reference: bit for bit.
With --contiguous-params the Megatron parameters live in one buffer per dtype, as megatron's DDP with the
distributed optimizer holds them (the kernel reads thousands of small separate allocations markedly slower:
docs/archive/results-2026-11.md, section 1). Prints a table; writes $OUT/bench_sync_<model>[_contiguous].json.
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

CONFIGS = {
    "llama8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                    tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2),
    # Qwen3-30B-A3B's layer shape, 12 of its 48 layers: the per-tensor cost ratio is the full model's.
    "qwen3moe12l": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                        num_experts_per_tok=8, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False, hidden_act="silu", norm_topk_prob=True, decoder_sparse_step=1,
                        mlp_only_layers=[], bos_token_id=1, eos_token_id=2),
}


# DeepSeek-V3's per-head and per-expert shapes, few of them (the GPU tiny example's model).
CONFIGS["dsv3tiny"] = json.loads((Path(__file__).resolve().parents[1] / "examples/deepseek_v3/tiny/gpu_config.json")
                                 .read_text())


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), 10)
    return 2 * nbytes / statistics.median(t)


def contiguous_params(chunks) -> None:
    """Move every parameter into one buffer per dtype (each at a 128-byte boundary) and rebind `.data` to it."""
    by_dtype: dict = {}
    for c in chunks:
        for p in c.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, params in by_dtype.items():
        align = 128 // params[0].element_size()
        offs, n = [], 0
        for p in params:
            offs.append(n)
            n += -(-p.numel() // align) * align
        flat = torch.empty(n, dtype=dtype, device=params[0].device)
        for p, o in zip(params, offs):
            view = flat[o:o + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
    torch.cuda.empty_cache()


def hf_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list]:
    out, cur, size = [], [], 0
    for n, t in named:
        b = t.numel() * t.element_size()
        if cur and size + b > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((n, t))
        size += b
    return out + ([cur] if cur else [])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama8b")
    ap.add_argument("--buckets-mb", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk", action="store_true", help="reference = SGLang loading the checkpoint from disk")
    ap.add_argument("--contiguous-params", action="store_true",
                    help="Megatron parameters as views into one buffer per dtype, as megatron's DDP with the "
                         "distributed optimizer holds them (default: one allocation per parameter)")
    args = ap.parse_args()

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models.builder import build_model
    from mtrain.reshard.local import reshard_in_memory
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.rollout.sglang_engine import SGLangEngine
    from mtrain.rollout.groups import EngineGroups
    from mtrain.trainer.publishers.colocated import WeightSync

    cfg = CONFIGS[args.model]
    res: dict = {"model": args.model, "config": cfg, "device": torch.cuda.get_device_name()}
    init_distributed()
    t0 = time.perf_counter()
    chunks, _ = build_model(cfg, params_dtype=torch.bfloat16)
    res["megatron_build_s"] = time.perf_counter() - t0
    res["contiguous_params"] = args.contiguous_params
    if args.contiguous_params:
        contiguous_params(chunks)
    layout, mlay = model_layout(cfg), MegatronLayout()
    lookup = tensor_lookup(chunks)
    hf_plan = build_plan(layout, mlay, HFLayout())
    convert = lambda: reshard_in_memory(hf_plan, lookup, dtype=torch.bfloat16, backend="triton", device="cuda")
    hf = convert()
    res["megatron_to_hf_s"] = statistics.median(timed(convert, args.repeats))
    named_hf = [(k[2], v) for k, v in hf.items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named_hf)
    res.update(bytes=nbytes, hf_tensors=len(named_hf))
    bw = copy_bandwidth()
    res["copy_GBps"] = bw / 1e9
    res["copy_floor_s"] = 2 * nbytes / bw

    work = tempfile.mkdtemp(prefix="mtrain-sync-")
    model_dir = os.path.join(work, "hf")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(dict(cfg, torch_dtype="bfloat16"), f)
    if args.disk:
        from mtrain.converters.safetensors_io import ShardedWriter
        t0 = time.perf_counter()
        with ShardedWriter(model_dir + ".st", max_shard_bytes=4 << 30) as w:
            for n, t in named_hf:
                w.add(n, t.cpu())
            w.commit()
        for fn in os.listdir(model_dir + ".st"):
            os.replace(os.path.join(model_dir + ".st", fn), os.path.join(model_dir, fn))
        res["write_checkpoint_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = SGLangEngine(model_dir, tp_size=1, mem_fraction_static=0.35, load_format="auto" if args.disk else "dummy",
                       server_args={"dtype": "bfloat16"})
    res["engine_start_s"] = time.perf_counter() - t0
    if not args.disk:
        eng.update_weights_hf_names(named_hf)
    reference = eng.weight_checksums()[0]["checksums"]

    def weight_sync(mode: str, bucket_mb: int):
        return WeightSync(layout, chunks, eng, groups=EngineGroups(1, 1, 1), engine_kind="sglang", dtype=torch.bfloat16,
                          bucket_bytes=bucket_mb << 20, backend="triton", device="cuda", mode=mode)

    version = [0]

    def run(ws):
        version[0] += 1
        ws.sync(version[0])

    rows = []
    for mb in args.buckets_mb:
        buckets = hf_buckets(named_hf, mb << 20)
        t_hf = timed(lambda: [eng.update_weights_hf_names(b) for b in buckets],
                     args.repeats)
        push = weight_sync("push", mb)
        run(push)  # warm-up: kernel compile, tables, IPC handle of the reused bucket buffer
        t_push = timed(lambda: run(push), args.repeats)
        t_pack = timed(lambda: [None for _ in push.executors[0].stream()], args.repeats)
        rows.append(dict(bucket_mb=mb, buckets=len(push.executors[0].buckets), hf_names_s=statistics.median(t_hf),
                         push_s=statistics.median(t_push), pack_only_s=statistics.median(t_pack)))
    one_call = timed(lambda: eng.update_weights_hf_names(named_hf), args.repeats)
    res["hf_names_one_call_s"] = statistics.median(one_call)
    pull = weight_sync("pull", args.buckets_mb[0])
    res["pull_first_sync_s"] = timed(lambda: run(pull), 1)[0]  # sends sources + tables, opens IPC handles
    res["pull_s"] = statistics.median(timed(lambda: run(pull), args.repeats))
    res["pull_engine_calls"] = len(pull.pulls[0].buckets)
    res["rows"] = rows

    # Bit-equality, per mode: garble the weights, sync, compare every parameter with the reference checksums.
    for mode, ws in (("pull", pull), ("push", weight_sync("push", args.buckets_mb[0]))):
        eng.randomize_weights()
        garbled = eng.weight_checksums()[0]["checksums"]
        run(ws)
        after = eng.weight_checksums()[0]["checksums"]
        res[f"{mode}_params_garbled_before_sync"] = sum(garbled[k] != reference[k] for k in reference)
        res[f"{mode}_params_mismatched_after_sync"] = sorted(k for k in reference if after.get(k) != reference[k])
    res["params_checked"] = len(reference)
    eng.shutdown()

    print(f"\n{args.model}: {nbytes / 1e9:.2f} GB in {len(named_hf)} HF tensors; copy {bw / 1e9:.0f} GB/s, "
          f"floor {res['copy_floor_s'] * 1e3:.1f} ms; Megatron->HF conversion {res['megatron_to_hf_s'] * 1e3:.1f} ms")
    print(f"{'bucket':>8} {'n':>4} {'HF-names ms':>12} {'push ms':>9} {'pack ms':>8} {'HF/push':>8} {'HF/pull':>8}")
    for r in rows:
        print(f"{r['bucket_mb']:>6}MB {r['buckets']:>4} {r['hf_names_s'] * 1e3:>12.1f} {r['push_s'] * 1e3:>9.1f} "
              f"{r['pack_only_s'] * 1e3:>8.1f} {r['hf_names_s'] / r['push_s']:>7.2f}x "
              f"{r['hf_names_s'] / res['pull_s']:>7.2f}x")
    print(f"pull: {res['pull_s'] * 1e3:.1f} ms ({res['pull_engine_calls']} engine call(s); first sync "
          f"{res['pull_first_sync_s'] * 1e3:.1f} ms), {res['pull_s'] / res['copy_floor_s']:.2f}x the copy floor; "
          f"HF-names one call {res['hf_names_one_call_s'] * 1e3:.1f} ms = "
          f"{res['hf_names_one_call_s'] / res['pull_s']:.2f}x pull")
    for mode in ("pull", "push"):
        print(f"{mode}: bit-equal after sync: {not res[f'{mode}_params_mismatched_after_sync']} "
              f"({res['params_checked']} params, {res[f'{mode}_params_garbled_before_sync']} garbled before)")
    out = os.environ.get("OUT")
    if out:
        suffix = "_contiguous" if args.contiguous_params else ""
        with open(os.path.join(out, f"bench_sync_{args.model}{suffix}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if not (res["pull_params_mismatched_after_sync"] or res["push_params_mismatched_after_sync"]) else 1


if __name__ == "__main__":
    sys.exit(main())
