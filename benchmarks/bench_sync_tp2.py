"""Weight sync into ONE SGLang engine at TP2 from training at TP2, two GPUs: pull with owners spread vs push vs
SGLang's HF-names path, same run, same model (issue 10 (b)).

    source benchmarks/gpu_setup.sh && torchrun --nproc-per-node 2 benchmarks/bench_sync_tp2.py --model llama8b

Rank r trains on GPU r (Megatron TP2, bf16, parameters contiguous as DDP with the distributed optimizer holds them).
Rank 0 leads one SGLang engine with tp_size 2 (engine rank r on GPU r). Pull: each training rank builds its own
engine rank's request (CUDA IPC views of its parameters + receive buffers for slices the other rank sends), the
leader sends both in one call. Push: the leader assembles both engine ranks' buckets. HF-names: full HF tensors
already on GPU 0 (gathered once, not timed), `update_weights_from_tensor` as peers call it. Reference: the engine's
checksums after SGLang's own loader took the HF tensors; each mode garbles the weights, syncs, and must match bit for
bit. Bytes that cross between GPUs are counted from the plan (only slices held on the other GPU travel) against the
bytes each engine rank writes. Writes $OUT/bench_sync_tp2_<model>.json on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sync import CONFIGS, contiguous_params, copy_bandwidth, timed  # noqa: E402


def crossing_bytes(ws) -> int:
    """Bytes received from the other GPU per pull sync, over both ranks (from the plan: only remote slices move)."""
    pull = ws.pulls[0]
    recv = sum(p.numel for b in pull.buckets for ps in pull.ex.transfers(b)[1].values() for p in ps)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, recv * pull.ex.dtype.itemsize)
    return sum(got)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama8b")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models.builder import build_model
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.megatron_side import current_layout, tensor_lookup
    from mtrain.reshard.placement import HFLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.rollout.groups import EngineGroups
    from mtrain.trainer.publishers.colocated import WeightSync

    cfg = CONFIGS[args.model]
    init_distributed(tp=2)
    rank = dist.get_rank()
    chunks, _ = build_model(cfg, params_dtype=torch.bfloat16)
    contiguous_params(chunks)
    layout, lookup = model_layout(cfg), tensor_lookup(chunks)
    # The engine starts first: SGLang refuses TP ranks whose GPUs have unequal free memory (bootstrap.py:269), and the
    # full HF tensors below live on GPU 0 only.
    eng = None
    if rank == 0:
        from mtrain.rollout.sglang_engine import SGLangEngine
        work = tempfile.mkdtemp(prefix="mtrain-sync-tp2-")
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(dict(cfg, torch_dtype="bfloat16"), f)
        t0 = time.perf_counter()
        eng = SGLangEngine(work, tp_size=2, base_gpu_id=0, mem_fraction_static=0.3, load_format="dummy",
                           server_args={"dtype": "bfloat16"})
        start_s = time.perf_counter() - t0
    dist.barrier()
    # Full HF tensors on rank 0 (the HF-names baseline's input; peers gather like this every sync).
    hf_plan = build_plan(layout, current_layout(), HFLayout(), colocate=lambda r: 0)
    hf = {k: torch.empty(ref.shape, dtype=torch.bfloat16, device="cuda")
          for k, ref in hf_plan.dst_tensors.items()} if rank == 0 else {}
    Executor(hf_plan, rank, lookup, dtype=torch.bfloat16, backend="triton", device="cuda").write_into(
        lambda ref: hf[(ref.rank, ref.chunk, ref.name)])
    named_hf = [(k[2], v) for k, v in hf.items()]
    res: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "gpus": 2}
    local_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    bw = copy_bandwidth(2 << 30)
    res["copy_GBps"] = bw / 1e9

    if rank == 0:
        res["engine_start_s"] = start_s
        eng.update_weights_hf_names(named_hf)
        reference = [r["checksums"] for r in eng.weight_checksums()]
    dist.barrier()
    groups = EngineGroups(2, 2, 2)
    ws = {m: WeightSync(layout, chunks, eng, groups=groups, engine_kind="sglang", dtype=torch.bfloat16,
                        bucket_bytes=args.bucket_mb << 20, backend="triton", device="cuda", mode=m)
          for m in ("pull", "push")}
    version = [0]

    written = {}

    def run(w):
        version[0] += 1
        written[w.mode] = w.sync(version[0])["sync/bytes"]
        torch.cuda.synchronize()
        dist.barrier()

    def hf_names():
        if rank == 0:
            eng.update_weights_hf_names(named_hf)
        dist.barrier()

    for m in ("pull", "push"):
        res[f"{m}_first_sync_s"] = timed(lambda: run(ws[m]), 1)[0]
        res[f"{m}_s_runs"] = timed(lambda: run(ws[m]), args.repeats)
    res["hf_names_s_runs"] = timed(hf_names, args.repeats)
    for k in ("pull", "push", "hf_names"):
        runs = res[f"{k}_s_runs"]
        res[f"{k}_s"] = statistics.median(runs)
        res[f"{k}_s_spread"] = [min(runs), max(runs)]
    res["crossing_bytes"] = crossing_bytes(ws["pull"])
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, written["pull"])  # bytes each engine rank wrote (float32 weights at 4 bytes)
    res["written_bytes"] = sum(got)
    per_gpu = res["written_bytes"] / 2
    res["copy_floor_s"] = 2 * per_gpu / bw  # read + write of the bytes each GPU's engine rank holds
    res["training_bytes_per_gpu"] = local_bytes
    res["pull_engine_calls"] = len(ws["pull"].pulls[0].buckets)

    for m in ("pull", "push"):  # bit-equality: garble, sync, compare every parameter on both engine ranks
        if rank == 0:
            eng.randomize_weights()
        dist.barrier()
        run(ws[m])
        if rank == 0:
            after = [r["checksums"] for r in eng.weight_checksums()]
            res[f"{m}_mismatched"] = sorted(f"rank{i}:{k}" for i, ref in enumerate(reference) for k in ref
                                            if after[i].get(k) != ref[k])
            res["params_checked"] = sum(len(r) for r in reference)
    dist.barrier()
    if rank == 0:
        eng.shutdown()
        print(f"\n{args.model} at training TP2 -> one SGLang engine TP2 on 2 GPUs: {res['written_bytes'] / 1e9:.2f} GB "
              f"written per sync, {res['crossing_bytes'] / 1e6:.1f} MB crossed between GPUs; copy {bw / 1e9:.0f} GB/s, "
              f"floor {res['copy_floor_s'] * 1e3:.1f} ms per GPU")
        for k in ("pull", "push", "hf_names"):
            lo, hi = res[f"{k}_s_spread"]
            print(f"{k:>9}: {res[f'{k}_s'] * 1e3:8.1f} ms (min {lo * 1e3:.1f}, max {hi * 1e3:.1f}; {args.repeats} runs) "
                  f"= {res[f'{k}_s'] / res['copy_floor_s']:.2f}x the floor")
        print(f"pull vs push {res['push_s'] / res['pull_s']:.2f}x, pull vs HF-names {res['hf_names_s'] / res['pull_s']:.2f}x")
        for m in ("pull", "push"):
            print(f"{m}: bit-equal after sync: {not res[f'{m}_mismatched']} ({res['params_checked']} params)")
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, f"bench_sync_tp2_{args.model}.json"), "w") as f:
                json.dump(res, f, indent=1)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
