"""Separate placement over NCCL on two GPUs: rank 0 trains (SmolLM2-135M in Megatron-core, TP1), rank 1 holds an
engine rank's parameters in SGLang's own layout; the weights go shard to shard (`mtrain.reshard.remote`, NCCL
batch_isend_irecv, the engine-side pull table executed by the Triton scatter kernel on rank 1's GPU).

Prints one JSON line: bit-equal (every engine parameter equal to SGLang's own slicing of the HF checkpoint,
tests/reshard/sglang_reference.py), the sync time (median of REPEATS syncs after 2 warm-ups), bytes and GB/s.
    torchrun --nproc-per-node 2 benchmarks/gpu_separate_two_gpu.py        (env: REPEATS=10, DTYPE=bfloat16)
benchmarks/gpu_separate_two_gpu.sh runs it, then the trainer's separate one_step vs colocated synchronous.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "reshard"))


def main() -> None:
    from mtrain.converters.safetensors_io import HFCheckpoint
    from mtrain.converters.smollm2 import smollm2_hf_dir
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.reshard import pull_protocol as P
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.remote import EngineRanks, RemoteSync, engine_plans
    from sglang_reference import sglang_rank_params

    dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
    repeats = int(os.environ.get("REPEATS", "10"))
    info = init_distributed(train_world=1)
    rank = dist.get_rank()
    hf_dir = Path(smollm2_hf_dir())
    cfg = json.loads((hf_dir / "config.json").read_text())
    layout = model_layout(dict(cfg, num_nextn_predict_layers=0), mtp=False)
    engines = EngineRanks.after(1, 1, 1)
    plans = engine_plans(layout, MegatronLayout(), SGLangLayout(tp=1), engines)
    dev = torch.device("cuda", torch.cuda.current_device())
    ckpt = HFCheckpoint(str(hf_dir))
    if info is not None:  # the training rank
        from mtrain.models import build_model
        from mtrain.reshard.megatron_side import load_hf_into_megatron, tensor_lookup
        chunks, _ = build_model(dict(cfg, num_nextn_predict_layers=0), params_dtype=dtype)
        load_hf_into_megatron(layout, chunks, ckpt.get, rank)
        sync = RemoteSync(plans, engines, rank, tensor_lookup(chunks), dtype=dtype, bucket_bytes=256 << 20,
                          device=dev)
        for _ in range(repeats + 2):
            dist.barrier()
            sync.run()
        dist.barrier()
        return
    plan = plans[0]
    params = {k[2]: torch.full(ref.shape, float("nan"), dtype=torch.float32 if k in plan.fp32 else dtype, device=dev)
              for k, ref in plan.dst_tensors.items()}
    sender, state = P.PullSender(1), P.PullState()

    def write(job, final):
        if job is not None:
            P.run_pull(params, sender.payload(0, job, final, torch.empty(0, device=dev)), state)
            sender.confirm(0, job)

    sync = RemoteSync(plans, engines, rank, dtype=dtype, bucket_bytes=256 << 20, device=dev)
    times, moved = [], 0.0
    for i in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moved = sync.run(write)["sync/bytes"]
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    hf = {n: ckpt.get(n) for n in {p.name for w in layout.weights for p in w.hf if p.write}}
    want = sglang_rank_params(hf, dict(cfg), 0, 1)
    bad = [n for n, t in want.items() if not torch.equal(params[n].cpu(), t.to(params[n].dtype))]
    med = statistics.median(times)
    print(json.dumps({"bit_equal": not bad, "mismatched": bad[:5], "params": len(want), "sync_s_median": med,
                      "sync_s_min": min(times), "sync_s_max": max(times), "bytes": moved,
                      "GB_per_s": moved / med / 1e9, "dtype": str(dtype)}), flush=True)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
