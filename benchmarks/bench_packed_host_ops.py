"""What the packed path dispatches per trainer step that the padded path does not, for the same tokens (issue 18).

The H200 run of 2026-11-30 put the packed path's step at 5.6-8.4 s against the fixed-length ceiling's
4.2-4.5 s on IDENTICAL tokens (bench_train_throughput's ceiling_packed vs ceiling), with the varlen flash
attention in use: host-side work, not FLOPs. This script counts that host work on the CPU, where it can be
counted exactly: one trainer step (logprob recompute + train forward/backward + optimizer step, the
bench's `one_step`) per mode under torch.profiler (CPU activities), and per step:
  - aten ops dispatched: all (nested included) and top-level (not inside another aten op), and by name;
  - ops that force a device -> host sync on CUDA (SYNC_OPS: .item()/float()/bool() of a tensor, nonzero and the
    boolean-mask indexing that calls it, masked_select, repeat_interleave without output_size, unique);
  - the growth: each mode is run at two depths and two sequence counts per micro-batch, so an op count that
    grows with layers x sequences (a Python loop over sequences inside a layer) shows as such.

Modes (the same fixed-length batch, so the same tokens): `padded` = the ceiling (micro-batches of budget // len
samples, padded path, Megatron's local attention), `packed` = the same samples through the packed path (budget
tokens per micro-batch). On a CPU the packed attention runs torch's SDPA once per sequence (no varlen kernel);
`--attention varlen-emulated` (the default) stands in for the GPU's single varlen launch per layer with one
block-diagonal-masked SDPA call, so what is counted is what a GPU run dispatches (`per-sequence`: the CPU path).

    OMP_NUM_THREADS=2 python benchmarks/bench_packed_host_ops.py                 # table, ~1 min on 2 cores
    OMP_NUM_THREADS=2 python benchmarks/bench_packed_host_ops.py --json out.json --top 40

A CUDA run (same command on the GPU box) counts the same ops plus the runtime's own syncs.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Sites whose sync-forcing ops read tensors that live on the host in a GPU run too (no device sync there):
# megatron-core's THD RoPE reads cu_seqlens, which the trainer hands it on the host (Pack.packed_seq_params), and
# the packing builds its index tensors on the host before the schedule runs.
HOST_TENSOR_SITES = ("rope_utils.py", "mtrain/trainer/packing.py")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
            "aten::_unique2", "aten::unique_consecutive", "aten::repeat_interleave", "aten::is_nonzero",
            "aten::equal")


def _emulate_varlen() -> None:
    """On a CPU: make mtrain's varlen branch run, with one block-diagonal causal SDPA standing in for
    torch.nn.attention.varlen.varlen_attn (one launch per layer, as on a GPU). For counting only."""
    from mtrain.models import varlen_attention as va

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=None, is_causal=None, scale=None,
                    enable_gqa=False):
        seg = torch.searchsorted(cu_q[1:], torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype), right=True)
        allowed = (seg[:, None] == seg[None, :]).tril()
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed,
            scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)

    names = frozenset({"window_size", "scale", "enable_gqa"})
    va._varlen = lambda: (fake_varlen, names)
    va.varlen_usable = lambda q, k, v: True


def count_step(step) -> dict:
    """Run `step` once under the profiler: aten op counts (all, top-level, by name) and the sync ops."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=True) as prof:
        step()
    by_name: collections.Counter = collections.Counter()
    top_level: collections.Counter = collections.Counter()
    by_site: collections.Counter = collections.Counter()  # top-level aten ops by the Python line that called them
    sync_sites: collections.Counter = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        by_name[e.name] += 1
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        site = _site(e)
        if p is None:
            top_level[e.name] += 1
            by_site[site] += 1
        if e.name in SYNC_OPS and e.name != "aten::_local_scalar_dense":
            sync_sites[f"{e.name} @ {site}"] += 1
    return {"all": sum(by_name.values()), "top_level": sum(top_level.values()), "by_name": dict(by_name),
            "top_level_by_name": dict(top_level), "sync_ops": {k: by_name[k] for k in SYNC_OPS if by_name[k]},
            "by_site": dict(by_site), "sync_sites": dict(sync_sites),
            "device_syncs": sum(c for k, c in sync_sites.items() if not any(h in k for h in HOST_TENSOR_SITES))}


def _site(e) -> str:
    """The innermost Python frame above an event in mtrain, megatron or benchmarks; 'backward' for ops of the
    autograd engine (no Python above them), '?' otherwise."""
    p = e.cpu_parent
    while p is not None:
        m = re.search(r"(mtrain/[^(]*|megatron/[^(]*|benchmarks/[^(]*)\((\d+)\): (\S+)", p.name)
        if m and "mtrain/compat/" not in m.group(1):  # the CPU shim's torch-function hook: look above it
            return f"{m.group(1)}:{m.group(2)} {m.group(3)}"
        p = p.cpu_parent
    return "backward" if "Backward" in _root(e).name or "autograd" in _root(e).name.lower() else "?"


def _root(e):
    while e.cpu_parent is not None:
        e = e.cpu_parent
    return e


def build(layers: int, budget: int, fixed_len: int, n_micro: int, dtype: str):
    """An Actor of the tiny Llama with `layers` layers and a fixed-length batch of n_micro micro-batches; the
    configs of the two modes."""
    from bench_train_throughput import LLAMA, MODELS, REPO, make_batch
    from mtrain.config import load_config
    from mtrain.trainer.learner.actor import Actor
    hf = dict(LLAMA, **dict(MODELS["tiny"], num_hidden_layers=layers))
    per_micro = budget // fixed_len
    base = [f"model.hf_path={REPO}", f"model.dtype={dtype}", "rollout.max_prompt_len=8",
            f"rollout.max_new_tokens={budget - 8}", "optim.lr=1e-7", "optim.use_distributed_optimizer=false",
            "algo.kl_coef=0", f"rollout.prompts_per_step={per_micro}", "rollout.samples_per_prompt=2"]

    def config(*extra):
        return load_config(REPO / "mtrain/configs/tiny_llama_grpo.yaml", base + list(extra))
    cfgs = {"padded": config(f"train.micro_batch_size={per_micro}"),
            "packed": config(f"train.max_tokens_per_micro_batch={budget}")}
    actor = Actor(cfgs["packed"], hf)
    batch = make_batch([(fixed_len // 2, fixed_len - fixed_len // 2)] * (per_micro * n_micro), hf["vocab_size"], 1)
    return actor, cfgs, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=256, help="tokens per micro-batch (packed)")
    ap.add_argument("--lens", type=int, nargs=2, default=(64, 32), help="two fixed sample lengths (sequence counts "
                    "per micro-batch budget // len)")
    ap.add_argument("--layers", type=int, nargs=2, default=(2, 4), help="two model depths")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--attention", choices=("varlen-emulated", "per-sequence"), default="varlen-emulated")
    ap.add_argument("--top", type=int, default=25, help="op names listed (largest packed - padded difference)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    from bench_train_throughput import one_step, single_process_env
    single_process_env()
    from mtrain.dist import init_distributed
    init_distributed(seed=0)
    if args.attention == "varlen-emulated" and not torch.cuda.is_available():
        _emulate_varlen()

    runs = {}
    for layers in args.layers:
        for flen in args.lens:
            actor, cfgs, batch = build(layers, args.budget, flen, args.micro, args.dtype)
            for mode in ("padded", "packed"):
                actor.cfg = cfgs[mode]
                one_step(actor, batch)  # warm-up (lazy inits, caches)
                runs[(layers, flen, mode)] = count_step(lambda: one_step(actor, batch))
            del actor
    l0, l1 = args.layers
    f0, f1 = args.lens
    s0, s1 = args.budget // f0, args.budget // f1
    print(f"per trainer step (logprob recompute + train step), {args.micro} micro-batches of {args.budget} tokens, "
          f"attention: {args.attention}, {args.dtype}")
    print(f"{'layers':>6} {'seq/mb':>6} {'mode':>7} {'aten ops':>9} {'top-level':>9} {'dev syncs':>9}  sync-forcing ops "
          f"(a device->host sync each on CUDA when the tensor is on the device)")
    for (layers, flen, mode), r in runs.items():
        print(f"{layers:6d} {args.budget // flen:6d} {mode:>7} {r['all']:9d} {r['top_level']:9d} {r['device_syncs']:9d}  "
              f"{r['sync_ops']}")
    print(f"(dev syncs: sync-forcing ops outside {HOST_TENSOR_SITES}, whose tensors are on the host in a GPU run too)")

    # growth per op name: d/d(layers) and d/d(layers x sequences) of the packed - padded difference
    def diff(layers, flen, name, key="by_name"):
        return runs[(layers, flen, "packed")][key].get(name, 0) - runs[(layers, flen, "padded")][key].get(name, 0)
    names = set()
    for r in runs.values():
        names |= set(r["by_name"])
    rows = []
    for n in names:
        d = {k: diff(*k, n) for k in ((l0, f0), (l0, f1), (l1, f0), (l1, f1))}
        per_layer = (d[(l1, f0)] - d[(l0, f0)]) / (l1 - l0)
        per_layer_seq = ((d[(l1, f1)] - d[(l0, f1)]) - (d[(l1, f0)] - d[(l0, f0)])) / ((l1 - l0) * (s1 - s0))
        pad = {k: runs[(*k, "padded")]["by_name"].get(n, 0) for k in ((l1, f1),)}
        pk = {k: runs[(*k, "packed")]["by_name"].get(n, 0) for k in ((l1, f1),)}
        rows.append((n, pad[(l1, f1)], pk[(l1, f1)], d[(l1, f1)], per_layer, per_layer_seq))
    rows.sort(key=lambda r: -abs(r[3]))
    print(f"\nby op name at {l1} layers, {s1} sequences per micro-batch (largest |packed - padded| first); growth of "
          f"the difference per layer per micro-batch-pass and per layer x sequence (fit over the 4 runs)")
    print(f"{'padded':>8} {'packed':>8} {'diff':>7} {'/layer':>8} {'/layer/seq':>10}  name")
    for n, a, b, d, pl, pls in rows[:args.top]:
        print(f"{a:8d} {b:8d} {d:7d} {pl:8.1f} {pls:10.2f}  {n}")
    tot = {k: runs[(*k, "packed")]["all"] - runs[(*k, "padded")]["all"] for k in ((l0, f0), (l0, f1), (l1, f0), (l1, f1))}
    pls = ((tot[(l1, f1)] - tot[(l0, f1)]) - (tot[(l1, f0)] - tot[(l0, f0)])) / ((l1 - l0) * (s1 - s0))
    sites = set()
    for r in runs.values():
        sites |= set(r["by_site"])
    srows = []
    for n in sites:
        d = {k: diff(*k, n, "by_site") for k in ((l0, f0), (l0, f1), (l1, f0), (l1, f1))}
        srows.append((n, runs[(l1, f1, "padded")]["by_site"].get(n, 0), runs[(l1, f1, "packed")]["by_site"].get(n, 0),
                      d[(l1, f1)], (d[(l1, f0)] - d[(l0, f0)]) / (l1 - l0),
                      ((d[(l1, f1)] - d[(l0, f1)]) - (d[(l1, f0)] - d[(l0, f0)])) / ((l1 - l0) * (s1 - s0))))
    srows.sort(key=lambda r: -abs(r[3]))
    print("\ntop-level aten ops by the Python line that dispatched them (same runs and columns)")
    print(f"{'padded':>8} {'packed':>8} {'diff':>7} {'/layer':>8} {'/layer/seq':>10}  site")
    for n, a, b, d, pl, pls in srows[:args.top]:
        print(f"{a:8d} {b:8d} {d:7d} {pl:8.1f} {pls:10.2f}  {n}")
    print(f"\nsync-forcing ops by site at {l1} layers, {s1} sequences per micro-batch (on CUDA only those on device "
          f"tensors sync; aten::item is counted with its site, _local_scalar_dense under it is not repeated)")
    for mode in ("padded", "packed"):
        for n, c in sorted(runs[(l1, f1, mode)]["sync_sites"].items(), key=lambda x: -x[1]):
            print(f"  {mode:7s} {c:5d}  {n}")
    growth = ((tot[(l1, f1)] - tot[(l0, f1)]) - (tot[(l1, f0)] - tot[(l0, f0)])) / ((l1 - l0) * (s1 - s0))
    print(f"\nall aten ops, packed - padded (layers, len): {tot}; per layer x sequence: {growth:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                                               "runs": {"/".join(map(str, k)): v for k, v in runs.items()}},
                                              indent=1))


if __name__ == "__main__":
    main()
