"""torch.profiler summary of one trainer step, for benchmarks/bench_train_throughput.py --profile.

What it answers: where a mode loses time. Per mode: the step's wall time under the profiler, the top ops by self
device (CUDA) time and by self CPU time with their call counts, how many kernels were launched, how many
host-device syncs happened (the CUDA runtime's synchronize calls, and aten::_local_scalar_dense: .item(),
.tolist(), float() of a device tensor), and how much of the wall time the GPU was busy (union of kernel
intervals / wall): a packed step that loses to the ceiling with the GPU busy 95 % of the time is slow in its
kernels; one with the GPU idle half the time is starved by the host.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")  # a device sync each on CUDA


def _self_device_us(e) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def _busy_us(events) -> tuple[float, int]:
    """(microseconds covered by at least one device kernel/memcpy, number of device events)."""
    spans = []
    for e in events:
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            tr = e.time_range
            spans.append((tr.start, tr.end))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy, len(spans)


def profile_step(step: Callable[[], object], top: int = 25, trace_path: str | None = None) -> dict:
    """Run `step` once under torch.profiler and summarise it (see the module docstring)."""
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts, record_shapes=False) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace_path:
        prof.export_chrome_trace(trace_path)
    avgs = prof.key_averages()

    def rows(key):
        ranked = sorted(avgs, key=key, reverse=True)[:top]
        return [{"name": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": _self_device_us(e) / 1e3} for e in ranked]

    counts = {e.key: int(e.count) for e in avgs}
    launches = sum(c for k, c in counts.items() if k.startswith(LAUNCH_PREFIXES))
    busy_us, device_events = _busy_us(prof.events())
    return {
        "wall_s": wall,
        "kernel_launches": launches if cuda else None,
        "device_events": device_events if cuda else None,
        "runtime_syncs": {k: counts.get(k, 0) for k in SYNC_NAMES} if cuda else None,
        "host_reads": {k: counts.get(k, 0) for k in HOST_READ_OPS},
        "gpu_busy_fraction": busy_us / 1e6 / wall if cuda and wall > 0 else None,
        "total_self_cpu_ms": sum(e.self_cpu_time_total for e in avgs) / 1e3,
        "top_by_self_device": rows(_self_device_us) if cuda else [],
        "top_by_self_cpu": rows(lambda e: e.self_cpu_time_total),
    }


def format_profiles(profiles: dict[str, dict]) -> str:
    """Readable text of {mode: profile_step(...)}."""
    out = []
    for mode, p in profiles.items():
        out.append(f"=== {mode}: one step under the profiler, {p['wall_s']:.3f} s wall")
        if p["kernel_launches"] is not None:
            out.append(f"kernel launches {p['kernel_launches']}, device events {p['device_events']}, "
                       f"GPU busy {p['gpu_busy_fraction']:.1%} of the wall time")
            out.append("runtime syncs: " + ", ".join(f"{k} {v}" for k, v in p["runtime_syncs"].items()))
        out.append("host reads of tensors (a device sync each on CUDA): " +
                   ", ".join(f"{k} {v}" for k, v in p["host_reads"].items()))
        for title, key in (("self device (CUDA) time", "top_by_self_device"), ("self CPU time", "top_by_self_cpu")):
            if not p[key]:
                continue
            dev = p["kernel_launches"] is not None  # no device column on a CPU-only run
            out.append(f"-- top ops by {title}")
            out.append((f"{'self dev ms':>12} " if dev else "") + f"{'self cpu ms':>12} {'calls':>8}  name")
            for r in p[key]:
                out.append((f"{r['self_device_ms']:12.2f} " if dev else "") +
                           f"{r['self_cpu_ms']:12.2f} {r['calls']:8d}  {r['name'][:110]}")
        out.append("")
    return "\n".join(out)
