"""Delta weight sync (sync.delta) against the full point-to-point sync, bytes and time per step, in the same run.

One training rank (Megatron, SmolLM2-135M's shape: 30 layers, hidden 576, 9/3 heads, vocabulary 49,152, tied
embeddings, random weights) and one engine rank (the HF layout of the reference engine), over gloo on CPU, as
`engine.placement=separate` runs them (mtrain/reshard/remote.py, mtrain/reshard/delta.py). Each step changes a share
`--changed` of every weight's elements (well beyond a bf16 unit, so each changes on the wire), then runs the full
sync and the delta sync into two parameter sets of the engine rank, checks them bit-equal, and times both
(barrier to barrier). Prints per share: the full sync's bytes, the delta's wire bytes and their ratio, and the
median (min-max) time of each over `--steps` steps.

    PYTHONPATH=$PWD python benchmarks/bench_delta_sync.py --changed 0.006 0.012 0.05 --steps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 2048}


def _rank_main(rank, world, layers, shares, steps, bucket_mb):
    import torch.distributed as dist

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models import build_model
    from mtrain.reshard import pull_protocol as P
    from mtrain.reshard.delta import DeltaExecutor, DeltaSender, delta_metrics
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.remote import EngineRanks, RemoteSync, engine_plans
    from mtrain.tiny_configs import tiny_config
    import functools

    torch.set_num_threads(1)
    info = init_distributed(tp=1, train_world=1)
    cfg = dict(tiny_config("llama"), **SMOLLM2, num_nextn_predict_layers=0)
    cfg["num_hidden_layers"] = layers
    layout = model_layout(cfg, mtp=False)
    engines = EngineRanks.after(1, 1, 1)
    plans = engine_plans(layout, MegatronLayout(tp=1, pp=1, ep=1, etp=1, dp=1), SGLangLayout(tp=1), engines)
    kw = dict(dtype=torch.bfloat16, bucket_bytes=bucket_mb << 20, backend="torch")
    rows = []
    if info is not None:  # the training rank
        chunks, _ = build_model(cfg, params_dtype=torch.float32)
        params = [p for c in chunks for p in c.parameters()]
        sender = DeltaSender()
        full = RemoteSync(plans, engines, rank, tensor_lookup(chunks), **kw)
        delta = RemoteSync(plans, engines, rank, tensor_lookup(chunks),
                           executor=functools.partial(DeltaExecutor, sender=sender), **kw)
        run_full, run_delta = (lambda: full.run()["sync/bytes"]), (lambda: (sender.begin(), delta.run()))
        gen = torch.Generator().manual_seed(0)
    else:  # the engine rank: two parameter sets, one per sync
        g, r = engines.engine_of(rank)
        sets = {}
        for name in ("full", "delta"):
            ps = {k[2]: torch.zeros(ref.shape, dtype=torch.bfloat16) for k, ref in plans[g].dst_tensors.items()
                  if k[0] == r}
            sets[name] = (ps, P.PullSender(1), P.PullState())

        def writer(name):
            ps, snd, state = sets[name]

            def write(job, final):
                if job is not None:
                    P.run_pull(ps, snd.payload(0, job, final, torch.empty(0)), state)
                    snd.confirm(0, job)
            return write
        full = RemoteSync(plans, engines, rank, **kw)
        delta = RemoteSync(plans, engines, rank, executor=DeltaExecutor, **kw)
        run_full, run_delta = (lambda: full.run(writer("full"))), (lambda: delta.run(writer("delta")))

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t0, out

    timed(run_full), timed(run_delta)  # first syncs: both full (the delta side has nothing kept yet)
    if info is None:
        delta_metrics(None, delta.executors)
    else:
        delta_metrics(sender, delta.executors)
    for share in shares:
        for step in range(steps):
            if info is not None:
                with torch.no_grad():
                    for p in params:
                        flat = p.view(-1)
                        k = max(1, round(flat.numel() * share))
                        idx = torch.randperm(flat.numel(), generator=gen)[:k]
                        flat[idx] += 0.25 * (1 + flat[idx].abs())  # far beyond a bf16 unit: each one changes
            t_full, full_bytes = timed(run_full)
            t_delta, _ = timed(run_delta)
            if info is not None:
                m = delta_metrics(sender, delta.executors)
                rows.append({"share": share, "step": step, "full_bytes": full_bytes, "t_full": t_full,
                             "t_delta": t_delta, **m})
            else:
                delta_metrics(None, delta.executors)
                a, b = sets["full"][0], sets["delta"][0]
                bad = [n for n in a if not torch.equal(a[n].view(torch.int16), b[n].view(torch.int16))]
                rows.append({"share": share, "step": step, "mismatched": len(bad)})
    dist.barrier()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changed", type=float, nargs="+", default=[0.006, 0.012, 0.05])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from mtrain.dist import run_on_ranks
    train, engine = run_on_ranks(_rank_main, 2, args.layers, args.changed, args.steps, args.bucket_mb, timeout=3000)
    assert all(r["mismatched"] == 0 for r in engine), "delta sync differs from the full sync's bits"
    summary = []
    for share in args.changed:
        rs = [r for r in train if r["share"] == share]
        full_b, delta_b = statistics.median(r["full_bytes"] for r in rs), statistics.median(r["sync/wire_bytes"] for r in rs)
        tf, td = [r["t_full"] for r in rs], [r["t_delta"] for r in rs]
        row = {"changed": share, "measured_changed_frac": statistics.median(r["sync/delta_changed_frac"] for r in rs),
               "full_MB": full_b / 1e6, "delta_MB": delta_b / 1e6, "bytes_ratio": delta_b / full_b,
               "t_full_s": [statistics.median(tf), min(tf), max(tf)],
               "t_delta_s": [statistics.median(td), min(td), max(td)],
               "time_ratio": statistics.median(d / f for d, f in zip(td, tf)), "steps": len(rs),
               "bit_equal_steps": sum(r["mismatched"] == 0 for r in engine if r["share"] == share)}
        summary.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from pathlib import Path
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "train": train}, indent=1))


if __name__ == "__main__":
    main()
