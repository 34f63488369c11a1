"""Resharding over NCCL on several GPUs, push and pull, against SGLang's own slicing (independent reference).

    source benchmarks/gpu_setup.sh && torchrun --nproc-per-node 2 benchmarks/gpu_reshard_nccl.py

One process per GPU. Each training rank holds only its own Megatron shards (tiny models, float32 and bf16) on its
GPU; engine rank r is owned by training rank r % world, i.e. one owner per GPU -- the layout multi-GPU pull mode
needs (docs/design-resharding.md). Per case and mode, two syncs (the second reuses tables, buffers and, in pull
mode, the engine's held sources):
- push: `Executor.stream` packs each owned engine rank's bucket with the compiled Triton kernel, slices from the
  other GPU arriving over NCCL;
- pull: `PullPlan.jobs` + the engine-side loader code (`pull_protocol.run_pull`, compiled scatter kernel) writing
  CUDA parameter tensors in this process (SGLang itself is not started: the engine's IPC hop is covered by
  bench_sync.py on one GPU).
Without a GPU it runs the same checks with gloo and the torch executor. Every owned engine rank's tensors must equal `tests/reshard/sglang_reference.py` bit for bit. Prints one line per
case, exits non-zero on any mismatch; rank 0 writes $OUT/reshard_nccl.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "reshard"))

from mtrain.layouts import model_layout  # noqa: E402
from mtrain.reshard.executor import Executor  # noqa: E402
from mtrain.reshard.placement import MegatronLayout, SGLangLayout  # noqa: E402
from mtrain.reshard.planner import build_plan  # noqa: E402
from mtrain.reshard.pull import PullPlan  # noqa: E402
from mtrain.reshard import pull_protocol as P  # noqa: E402
from mtrain.tiny_configs import tiny_config  # noqa: E402
from sglang_reference import sglang_rank_params  # noqa: E402
from test_plan_sglang import random_hf_state, to_megatron  # noqa: E402

CASES = [  # (arch, training layout for 2 ranks, engine tp, engine ep)
    ("qwen2", MegatronLayout(tp=2), 1, 1),
    ("llama", MegatronLayout(tp=2), 2, 1),
    ("qwen3_moe", MegatronLayout(ep=2, dp=2), 2, 1),
    ("deepseek_v3", MegatronLayout(tp=2), 2, 2),
    ("deepseek_v3_no_qlora", MegatronLayout(pp=2), 2, 1),
]


def run_case(rank: int, world: int, arch: str, train: MegatronLayout, etp: int, eep: int, dtype) -> list[str]:
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = tiny_config(arch)
    layout = model_layout(cfg)
    hf = random_hf_state(layout)
    mine = {k: v.to(dev, dtype) for k, v in to_megatron(layout, hf, train).items() if k[0] == rank}
    hf = {k: v.to(dtype).float() for k, v in hf.items()}
    plan = build_plan(layout, train, SGLangLayout(tp=etp, ep=eep), colocate=lambda r: r % world)
    owned = [r for r in range(etp) if r % world == rank]
    errors = []

    def check(got: dict, mode: str) -> None:
        for r in owned:
            for name, ref in sglang_rank_params(hf, cfg, r, etp, eep).items():
                t = got.get((r, name))
                if t is None or not torch.equal(t.cpu(), ref.to(t.dtype)):
                    errors.append(f"{mode} {arch} engine rank {r}: {name}")

    ex = Executor(plan, rank, lambda ref: mine[(ref.rank, ref.chunk, ref.name)], dtype=dtype,
                  bucket_bytes=1 << 16, backend="triton" if dev.type == "cuda" else "torch", device=dev)
    for _ in range(2):
        got = {}
        for bucket in ex.stream():
            for r, named in bucket.items():
                for name, t in named:
                    got[(r, name)] = t.clone()
        check(got, "push")

    pull = PullPlan(ex)
    params = {r: {k[2]: torch.full(ref.shape, float("nan"), dtype=torch.float32 if k in plan.fp32 else dtype,
                                   device=dev) for k, ref in plan.dst_tensors.items() if k[0] == r} for r in owned}
    states, sender = {r: P.PullState() for r in owned}, P.PullSender(etp)
    for _ in range(2):
        for p in params.values():
            for v in p.values():
                v.fill_(float("nan"))
        for i, bucket in enumerate(pull.jobs()):  # each bucket applied before the next is requested
            for r, job in bucket.items():
                payload = sender.payload(r, job, finish=i == len(pull.buckets) - 1, marker=torch.empty(0, device=dev))
                P.run_pull(params[r], payload, state=states[r])
                sender.confirm(r, job)
        check({(r, n): t for r, p in params.items() for n, t in p.items()}, "pull")
    return errors


def main() -> int:
    gpu = torch.cuda.is_available()  # without one: gloo + the torch executor, a dry run of the same checks
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    results = []
    for arch, train, etp, eep in CASES:
        if train.world != world:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            errors = run_case(rank, world, arch, train, etp, eep, dtype)
            all_errors = [None] * world
            dist.all_gather_object(all_errors, errors)
            flat = [e for es in all_errors for e in es]
            results.append(dict(arch=arch, train=repr(train), engine_tp=etp, engine_ep=eep, dtype=str(dtype),
                                mismatches=flat))
            if rank == 0:
                print(f"{arch:22} train {train.tp=} {train.pp=} {train.ep=} engine tp{etp} ep{eep} {dtype}: "
                      f"{'bit-equal (push, pull)' if not flat else flat[:3]}", flush=True)
    ok = all(not r["mismatches"] for r in results)
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "reshard_nccl.json"), "w") as f:
            json.dump(dict(world=world, device=torch.cuda.get_device_name() if gpu else "cpu", results=results, ok=ok),
                      f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
