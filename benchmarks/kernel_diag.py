"""Per-process diagnostics for bench_kernel.py: what the kernel was given and how the host kept up.

The MoE bucket ran at ~50 % of copy bandwidth in some processes and ~82 % in others of the same command
(issue 15, point 4). The tile table is the same in every process (checked on CPU under several
PYTHONHASHSEEDs: docs/archive/results-2026-11.md, "MoE bucket spread"), so each run records what else could differ
between processes, to tell the causes apart from one GPU call:
  - the tile table's fingerprint and size stats (must be equal across runs),
  - the alignment of every source and of the destination (mod 128 / 256 / 4096 bytes, offset in a 2 MiB
    page) and the address span (the caching allocator's layout, cudaMalloc's addresses),
  - the host time of one call (validation, source table, launch) against the GPU time of the kernel
    alone: the do_bench figure measures from an event recorded before the host work, so when that work
    takes longer than the GPU's queue holds, it is counted in (the slow runs' torch executor, which is
    host bound, was also 1.6x slower, and only in the slow runs),
  - the kernel alone in both tile orders (tiling.TILE_ORDERS), and the full call as it was before the
    per-call host caches (validate_call's last-call reuse, the cached source table), in the same process.
"""
from __future__ import annotations

import collections
import hashlib
import os
import statistics
import time

import numpy as np
import torch


def tile_summary(plan) -> dict:
    """Fingerprint and shape of a tiling.TilePlan: equal fingerprints = the kernel got the same work list."""
    t = plan.tiles
    elems = t[:, 5] * t[:, 6]
    full = int((elems == plan.block_r * plan.block_c).sum())
    strided = int(((t[:, 5] > 1) & ((t[:, 2] != t[:, 6]) | (t[:, 4] != t[:, 6]))).sum())
    return dict(sha256=hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()[:16], tiles=len(t),
                block_r=plan.block_r, block_c=plan.block_c, full_tiles=full, strided_tiles=strided,
                elems_min=int(elems.min()) if len(t) else 0, elems_median=float(np.median(elems)) if len(t) else 0,
                sources_touched=int(len(np.unique(t[t[:, 0] >= 0, 0]))))


def address_summary(ptrs: list[int]) -> dict:
    """Alignment histograms ({residue: count}) and the span of a list of device addresses."""
    a = np.asarray(ptrs, dtype=np.int64)
    out = {}
    for mod in (128, 256, 4096):
        out[f"mod{mod}"] = {str(k): v for k, v in sorted(collections.Counter((a % mod).tolist()).items())}
    # offset inside a 2 MiB page, in 64 KiB units: which part of a large page each allocation starts in
    out["in_2mib_64k_units"] = {str(k): v for k, v in
                                sorted(collections.Counter(((a % (1 << 21)) >> 16).tolist()).items())}
    out["span_gb"] = float((a.max() - a.min()) / 1e9) if len(a) else 0.0
    out["distinct_2mib_pages_of_starts"] = int(len(np.unique(a >> 21)))
    out["lowest_hex"] = hex(int(a.min())) if len(a) else None
    return out


def host_summary() -> dict:
    """The CPU this process ran on and how busy the host was: the slow state tracks the host."""
    info = dict(loadavg=os.getloadavg(), cpus_allowed=len(os.sched_getaffinity(0)), pid=os.getpid(),
                pythonhashseed=os.environ.get("PYTHONHASHSEED"))
    try:
        with open("/proc/self/stat") as f:
            info["cpu_now"] = int(f.read().rsplit(")", 1)[1].split()[36])
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        if mhz:
            info["cpu_mhz_min_median_max"] = (min(mhz), statistics.median(mhz), max(mhz))
    except (OSError, IndexError, ValueError):
        pass
    return info


def host_ms(fn, device: torch.device, n: int | None = None) -> float:
    """Median host wall time of one call that starts with the GPU idle (the call returns once it has
    queued its launch, so this is the host work alone)."""
    times = []
    for _ in range(n or (20 if device.type == "cuda" else 2)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def back_to_back_ms(fn, device: torch.device, n: int = 30) -> float:
    """Per-call time of n calls queued back to back (no cache clearing between them): the GPU's time
    if the host keeps ahead of it, the host's time if not."""
    if device.type != "cuda":  # the interpreter: a smoke run only
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t0) / 2 * 1e3
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def gpu_only_ms(fn, device: torch.device, n: int = 10, sleep_cycles: int = 50_000_000) -> float:
    """Median GPU time of fn's launches alone, its host work left out: a sleep kernel queued first (~25 ms at
    the H200's clock) keeps the GPU busy while the host does fn's work, so the start event runs only once fn's
    launches are queued behind it. Valid while the sleep outlasts fn's host work (host_ms says by how much) and fn
    does not synchronize; on the CPU the whole call is timed."""
    if device.type != "cuda":
        return host_ms(fn, device, n=2)
    fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def uncached(table, fn):
    """fn with the per-call host caches of this table dropped before each call: the host work of a call
    as it was before those caches (validate_call's last-call reuse, the source table and its copy)."""
    def call():
        cache = table.derived()
        cache.pop("last_call", None)
        cache.pop("src_info", None)
        fn()
    return call
