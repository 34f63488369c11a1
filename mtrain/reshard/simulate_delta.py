"""What sync.delta (docs/design-delta-sync.md) would save on a full-scale sync: the simulator's plan, with every
point-to-point message re-priced as a delta of a given changed fraction.

    python -m mtrain.reshard.simulate_delta --changed 0.006,0.012,0.05 --config deepseek_v3 \\
        --train tp=1,pp=16,ep=32 --world 512 --engine tp=8,ep=8 --engines 1

The plan and the per-GPU byte counts are `mtrain.reshard.simulate`'s; only the link model changes, from what the
delta executor does per message (mtrain/reshard/delta.py):
  wire bytes   a fraction f of a buffer's elements changed travels as f * (index + value) bytes per element when
               that is smaller than the whole buffer (int32 indices, bf16 values: 3 f of the full bytes, f < 1/3),
               else whole; local copies never travel and are unchanged
  sender HBM   pack (read + write, as before), then compare with the kept buffer (read both), then the DMA reads
               the delta: (4 + w) * sent instead of 3 * sent, w = the wire share (3 f or 1)
  receiver HBM the DMA writes the delta, it is scattered into the mirror (negligible at small f), the mirror is
               copied into the receive buffer (read + write), then unpacked as before: (4 + w) * received
So a delta trades HBM traffic (always more) for link bytes (fewer when f < 1/3): it pays where the links, not the
HBM, bound the sync. A prediction under the simulator's assumptions (no latency, perfect overlap), not a measurement;
it also assumes every message has the same changed fraction.
"""
from __future__ import annotations

import argparse
import sys

from mtrain.layouts import LayoutError
from mtrain.reshard import simulate as sim

INDEX_BYTES = 4  # int32 indices (int64 only for buffers of 2^31 elements or more: none at a 1 GiB bucket of bf16)


def wire_share(changed: float, itemsize: int = 2) -> float:
    """The share of a full message's bytes a delta sends: sparse below the break-even, whole above it."""
    if not 0.0 <= changed <= 1.0:
        raise sim.SimulationError(f"--changed: {changed} is not a fraction in [0, 1]")
    sparse = changed * (INDEX_BYTES + itemsize) / itemsize
    return min(sparse, 1.0)


def delta_link_times(s: sim.RankStats, hw: sim.Hardware, changed: float, itemsize: int = 2) -> dict[str, float]:
    """simulate.link_times for one GPU whose point-to-point messages are deltas of `changed`."""
    w = wire_share(changed, itemsize)
    hbm = 2 * s.local + (4 + w) * s.sent + (4 + w) * s.received + s.zero
    t = {"hbm": hbm / hw.hbm_bw,
         "nvlink": w * max(s.sent_nvlink, s.recv_nvlink) / hw.nvlink_bw,
         "ib": w * max(s.sent_ib, s.recv_ib) / hw.ib_bw,
         "launch": s.launches * hw.launch_s + s.buckets * hw.per_bucket_s}
    t["overlap"] = max(t["hbm"], t["nvlink"], t["ib"]) + t["launch"]
    t["serial"] = t["hbm"] + t["nvlink"] + t["ib"] + t["launch"]
    return t


def compare(rep: sim.Report, hw: sim.Hardware, changed: list[float]) -> list[dict]:
    """Per changed fraction: the slowest GPU's predicted sync (overlapped, serial) and the largest per-GPU IB
    ingress, against the full point-to-point sync of the same plan."""
    full = {g: sim.link_times(s, hw) for g, s in rep.per_gpu.items()}
    rows = [{"changed": None, "wire_share": 1.0,
             "overlap_s": max(t["overlap"] for t in full.values()),
             "serial_s": max(t["serial"] for t in full.values()),
             "ib_bytes_max": max(max(s.sent_ib, s.recv_ib) for s in rep.per_gpu.values())}]
    for f in changed:
        w = wire_share(f)
        ts = {g: delta_link_times(s, hw, f) for g, s in rep.per_gpu.items()}
        rows.append({"changed": f, "wire_share": w,
                     "overlap_s": max(t["overlap"] for t in ts.values()),
                     "serial_s": max(t["serial"] for t in ts.values()),
                     "ib_bytes_max": w * rows[0]["ib_bytes_max"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtrain.reshard.simulate_delta", description=__doc__.split("\n")[0])
    ap.add_argument("--changed", default="0.006,0.012,0.05",
                    help="changed fractions of the elements per sync (NeMo-DCR: 0.6-1.2 %% per GRPO step)")
    sim.add_plan_arguments(ap)
    a = ap.parse_args(argv)
    try:
        changed = [float(x) for x in a.changed.split(",") if x.strip()]
        for f in changed:
            wire_share(f)
        rep, hw = sim.simulate_from_args(a)
    except (sim.SimulationError, LayoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"training {rep.train} -> {rep.engines} engine(s) {rep.engine}; bucket {a.bucket_mb} MiB")
    print(" changed   wire share  max IB per GPU (GB)  overlapped s  serial s")
    for r in compare(rep, hw, changed):
        label = "full" if r["changed"] is None else f"{100 * r['changed']:.1f} %"
        print(f" {label:>8} {r['wire_share']:11.3f} {r['ib_bytes_max'] / 1e9:20.2f} {r['overlap_s']:13.3f} "
              f"{r['serial_s']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
