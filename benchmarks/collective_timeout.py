"""A stalled or dead rank must end the job with an error within the collective timeout, never a silent hang.

    torchrun --nproc-per-node 2 benchmarks/collective_timeout.py --fault hang --timeout-s 20   # 2 GPUs: NCCL
    torchrun --nproc-per-node 2 benchmarks/collective_timeout.py --fault die  --timeout-s 20
    (on a machine without GPUs the same commands use gloo; tests/test_collective_timeout.py runs them)

Every rank runs a few all-reduces through `mtrain.dist.init_distributed(timeout_s=...)` (the path `mtrain train`
takes with train.collective_timeout_s; in Megatron's TP group, where training's collectives run), then the last rank stalls (`hang`: sleeps far past the timeout, outside
any collective, as a rank stuck in a data loader or a deadlock would) or exits (`die`), while rank 0 enters
the next all-reduce. Rank 0 prints one JSON line with how long it waited and what it raised (gloo raises;
NCCL's watchdog tears the process down, so on GPU torchrun's exit and wall time are the evidence). The command
exits non-zero; the caller measures the wall time of the whole torchrun job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=("hang", "die"), required=True)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from mtrain.dist import init_distributed
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(tp=world, timeout_s=args.timeout_s)  # all-reduces in a Megatron subgroup (TP), as training
    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x = torch.ones(1024, device=dev)
    for _ in range(3):
        dist.all_reduce(x, group=group)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if rank == world - 1:
        if args.fault == "die":
            os._exit(3)
        time.sleep(args.timeout_s * 20)  # stalled: torchrun must end this rank once the others fail
        return 0
    t0 = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # NCCL is asynchronous: the wait (and the watchdog's abort) happen here
        waited = time.monotonic() - t0
        # NCCL: the peer never joined, so the all-reduce cannot have completed; the watchdog aborted the communicator
        # (it then takes the process down: about 60 s after the timeout on torch 2.11)
        outcome = ("returned after NCCL's watchdog aborted the communicator" if dist.get_backend() == "nccl"
                   and waited >= args.timeout_s else "completed (no fault seen: a bug)")
    except Exception as e:  # noqa: BLE001 - reporting what the backend raised is the point
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps({"rank": rank, "fault": args.fault, "backend": dist.get_backend(),
                      "timeout_s": args.timeout_s, "waited_s": round(time.monotonic() - t0, 2),
                      "outcome": outcome}), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
