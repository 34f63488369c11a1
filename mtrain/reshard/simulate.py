"""Predict a weight sync at full scale without any tensors: plan it, count bytes per link, apply a link model.

    python -m mtrain.reshard.simulate --config deepseek_v3 --train tp=1,pp=16,ep=32 --engine tp=8,ep=8

The planner only does arithmetic on shapes, so the real DeepSeek-V3 671B plan can be built on a laptop.
For every engine (engine e of `engine.tp` ranks sits on training ranks e*tp .. e*tp+tp-1: one engine per
node for TP8) this builds the plan and counts, per training rank (= per GPU) and per engine rank:
bytes copied locally, bytes sent/received over NVLink (same node) and InfiniBand (other node), pieces,
kernel launches and buckets, exactly as `Executor.stream` would issue them for a bucket size.

Link model (per GPU, no latency, perfect overlap of buckets, no switch congestion; a prediction only):
  HBM traffic = 2*local + 3*sent + 3*received + zero-fill   (pack: read+write, DMA read; DMA write, unpack)
  t_overlap   = max(HBM/hbm_bw, NVLink out/in / nvlink_bw, IB out/in / ib_bw) + launches * launch_s
                + buckets * per_bucket_s (one engine call per bucket, measured on the H200)
  t_serial    = the sum of the same terms (nothing overlaps)
  t_ingress   = max(IB in / ib_bw, NVLink in / nvlink_bw): what a relay/broadcast tree that balances
                egress would reach (the executor as written sends point to point from the source rank)
The sync time is the maximum over GPUs. The peers' full-gather baseline gets the same model: every engine
GPU receives every tensor at full size (whatever its own ranks hold), renamed to HF names, then SGLang's
loader slices its shard (HBM: land + relay the full model, read+write the shard), plus a measured
per-tensor cost of SGLang's loader.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtrain.layouts import LayoutError, ModelLayout, model_layout
from mtrain.layouts.table import Weight
from mtrain.reshard.executor import make_buckets
from mtrain.reshard.placement import MegatronLayout, SGLangLayout, parts_of
from mtrain.reshard.planner import Plan, build_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = {"deepseek_v3": EXAMPLES / "deepseek_v3" / "full" / "config.json"}
# DeepSeek-V3's 61 layers over PP16, as verl's and NeMo-RL's recipes split them (3 dense first, 2 last).
DEFAULT_UNEVEN = {("deepseek_v3", 61, 16): (3, 2)}


class SimulationError(ValueError):
    """A simulation setting that cannot be used (names the setting)."""


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    hbm_bw: float = 4.2e12  # bytes/s of read+write traffic (DESIGN.md: measured copy floor on the H200)
    nvlink_bw: float = 450e9  # bytes/s per direction per GPU (NVLink4, H100/H200)
    ib_bw: float = 50e9  # bytes/s per direction per GPU (one 400 Gb/s NDR NIC per GPU)
    launch_s: float = 5e-6  # per kernel launch / NCCL call
    # Handing one bucket to SGLang: DESIGN.md's Llama-8B sync took 112 ms in 32 calls and 35 ms in one, so
    # about 2.5 ms per call on top of the bytes (measured with HF names; the direct loader's cost is unknown).
    per_bucket_s: float = 2.5e-3
    # SGLang's update_weights_from_tensor by HF names costs about this per tensor (DESIGN.md: 2,286 ms for
    # 18,867 tensors of Qwen3-30B-A3B on one H200): used for the full-gather baseline only.
    per_tensor_s: float = 2.286 / 18867

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


def parse_sizes(text: str, what: str, allowed: tuple[str, ...]) -> dict[str, int]:
    """'tp=1,pp=16,ep=32' -> {'tp': 1, 'pp': 16, 'ep': 32}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in allowed:
            raise SimulationError(f"--{what}: '{item}' must look like NAME=INT with NAME one of {', '.join(allowed)}")
        try:
            out[key] = int(value)
        except ValueError:
            raise SimulationError(f"--{what}: {key}={value!r} is not an integer") from None
        if out[key] < 1:
            raise SimulationError(f"--{what}: {key} must be >= 1, got {out[key]}")
    return out


def training_layout(cfg: dict, sizes: dict[str, int], world: int | None) -> MegatronLayout:
    """A Megatron layout from tp/pp/ep/etp/cp/dp (dp from the world size when absent)."""
    tp, pp, cp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("cp", 1)
    dp = sizes.get("dp")
    if dp is None:
        if world is None or world % (tp * pp * cp):
            raise SimulationError(f"--world {world} is not divisible by tp*pp*cp ({tp}*{pp}*{cp}); give dp= or --world")
        dp = world // (tp * pp * cp)
    first, last = sizes.get("first"), sizes.get("last")
    layers = cfg["num_hidden_layers"]
    if first is None and last is None and layers % pp:
        first, last = DEFAULT_UNEVEN.get((cfg.get("model_type"), layers, pp), (None, None))
    return MegatronLayout(tp=tp, pp=pp, ep=sizes.get("ep", 1), etp=sizes.get("etp"), cp=cp, dp=dp,
                                first_stage_layers=first, last_stage_layers=last)


@dataclass
class RankStats:
    """What one GPU does in a sync. Bytes are of the destination dtype."""

    written: int = 0  # destination bytes this GPU writes (as an engine rank's owner)
    local: int = 0  # of those, copied from this GPU's own training tensors
    zero: int = 0  # of those, zero-filled (vocabulary padding)
    recv_nvlink: int = 0
    recv_ib: int = 0
    sent_nvlink: int = 0
    sent_ib: int = 0
    pieces_local: int = 0
    pieces_recv: int = 0
    pieces_sent: int = 0
    fill_launches: int = 0  # one per bucket per destination rank owned (Executor._fill)
    pack_launches: int = 0  # one per bucket per peer sent to (Executor._pack)
    buckets: int = 0  # buckets in which this GPU writes something

    def add(self, other: "RankStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def launches(self) -> int:
        return self.fill_launches + self.pack_launches

    @property
    def received(self) -> int:
        return self.recv_nvlink + self.recv_ib

    @property
    def sent(self) -> int:
        return self.sent_nvlink + self.sent_ib


def link_times(s: RankStats, hw: Hardware) -> dict[str, float]:
    """Seconds each link of one GPU is busy, and the overlapped / serial / ingress-bound predictions."""
    hbm = 2 * s.local + 3 * s.sent + 3 * s.received + s.zero
    t = {"hbm": hbm / hw.hbm_bw,
         "nvlink": max(s.sent_nvlink, s.recv_nvlink) / hw.nvlink_bw,
         "ib": max(s.sent_ib, s.recv_ib) / hw.ib_bw,
         "launch": s.launches * hw.launch_s + s.buckets * hw.per_bucket_s}
    t["overlap"] = max(t["hbm"], t["nvlink"], t["ib"]) + t["launch"]
    t["serial"] = t["hbm"] + t["nvlink"] + t["ib"] + t["launch"]
    t["ingress"] = max(s.recv_ib / hw.ib_bw, s.recv_nvlink / hw.nvlink_bw)
    return t


def plan_stats(plan: Plan, hw: Hardware, bucket_bytes: int, itemsize: int) -> dict[int, RankStats]:
    """Per GPU (training rank) statistics of one plan, with owners from plan.owner."""
    stats: dict[int, RankStats] = defaultdict(RankStats)
    owner_of = lambda dst_rank: plan.owner.get(dst_rank, dst_rank)  # noqa: E731
    for p in plan.pieces:
        o, b = owner_of(p.dst.rank), p.numel * itemsize
        so = stats[o]
        so.written += b
        if p.src is None:
            so.zero += b
            so.pieces_local += 1
        elif p.src.rank == o:
            so.local += b
            so.pieces_local += 1
        else:
            ss = stats[p.src.rank]
            if hw.node(p.src.rank) == hw.node(o):
                so.recv_nvlink += b
                ss.sent_nvlink += b
            else:
                so.recv_ib += b
                ss.sent_ib += b
            so.pieces_recv += 1
            ss.pieces_sent += 1
    for bucket in make_buckets(plan, bucket_bytes, itemsize):
        writers = {(owner_of(k[0]), k[0]) for k in bucket.keys}
        for o, _ in writers:
            stats[o].fill_launches += 1
        for o in {o for o, _ in writers}:
            stats[o].buckets += 1
        for src, o in {(p.src.rank, owner_of(p.dst.rank)) for p in bucket.pieces if p.src is not None}:
            if src != o:
                stats[src].pack_launches += 1
    return dict(stats)


def engine_colocate(engine: int, engine_tp: int):
    """Engine `engine`'s rank r lives on the GPU of training rank engine*engine_tp + r."""
    return lambda r: engine * engine_tp + r


def _weight_bytes(w: Weight, itemsize: int) -> int:
    return _numel(w.shape) * itemsize


def full_gather_stats(model: ModelLayout, train: MegatronLayout, engine: SGLangLayout, engine_index: int,
                      written: dict[int, int], hw: Hardware, itemsize: int) -> dict[int, dict]:
    """The peers' path for one engine: every engine GPU ends up with every weight at full size (HF names).

    Per GPU: `local` bytes it already holds (its own training shards), `node` bytes held somewhere on its
    node (NVLink reach); the rest crosses InfiniBand. Egress is assumed balanced by a broadcast tree.
    """
    colocate = engine_colocate(engine_index, engine.tp)
    ranks = [colocate(r) for r in range(engine.tp)]
    full = 0
    tensors = 0
    local = defaultdict(int)
    node = defaultdict(int)
    for w in model.weights:
        if not any(p.write for p in parts_of(engine, w)):
            continue
        full += _weight_bytes(w, itemsize)
        tensors += sum(1 for p in w.hf if p.write)
        holders = train.holders(model, w)
        numel_full = _weight_bytes(w, 1)
        by_rank = defaultdict(set)
        shard_bytes = {}
        for h in holders:
            part = parts_of(train, w)[h.part]
            rows = part.rows[1] - part.rows[0]
            shape, _ = part.rule.shard((rows, w.shape2d[1]), h.rule_rank, h.rule_world)
            key = (h.part, h.rule_rank)
            shard_bytes[key] = min(shape[0] * shape[1], numel_full) * itemsize
            by_rank[h.rank].add(key)
        for g in ranks:
            local[g] += sum(shard_bytes[k] for k in by_rank.get(g, ()))
            on_node = set().union(*[by_rank.get(x, set()) for x in by_rank if hw.node(x) == hw.node(g)] or [set()])
            node[g] += min(sum(shard_bytes[k] for k in on_node), _weight_bytes(w, itemsize))
    out = {}
    for r, g in enumerate(ranks):
        ib_in, nvl_in = full - node[g], node[g] - local[g]
        hbm = 2 * full + 2 * written.get(g, 0)
        t = {"hbm": hbm / hw.hbm_bw, "nvlink": nvl_in / hw.nvlink_bw, "ib": ib_in / hw.ib_bw,
             "per_tensor": tensors * hw.per_tensor_s}
        t["ingress"] = max(t["hbm"], t["nvlink"], t["ib"])
        t["with_loader"] = t["ingress"] + t["per_tensor"]
        out[g] = dict(engine_rank=r, full=full, tensors=tensors, local=local[g], recv_nvlink=nvl_in,
                      recv_ib=ib_in, times=t)
    return out


@dataclass
class Report:
    model_bytes: int  # engine-visible parameters at full size (HF bytes, no MTP)
    engine_written: int  # bytes one engine's ranks write (replicated weights once per rank)
    train: dict
    engine: dict
    engines: int
    per_gpu: dict[int, RankStats]  # summed over all planned engines
    per_engine_rank: list[dict[int, RankStats]]  # per planned engine: engine rank -> its owner's stats
    baseline: dict[int, dict]  # full gather, engine 0's GPUs
    plan_seconds: float
    pieces_per_engine: int
    extra: dict = field(default_factory=dict)


def simulate(cfg: dict, train: MegatronLayout, engine: SGLangLayout, *, engines: int | None = None,
             engine_ids: list[int] | None = None, hw: Hardware = Hardware(), bucket_bytes: int = 512 << 20,
             itemsize: int = 2, model: ModelLayout | None = None) -> Report:
    """Plan every engine (or `engine_ids`) against the training layout and gather per-GPU statistics."""
    world = train.world
    if world % engine.tp:
        raise SimulationError(f"training world {world} is not divisible by engine tp {engine.tp}")
    max_engines = world // engine.tp
    engines = engines or max_engines
    if engines > max_engines:
        raise SimulationError(f"--engines {engines}: only {max_engines} engines of tp {engine.tp} fit on {world} GPUs")
    model = model or model_layout(cfg)
    ids = engine_ids if engine_ids is not None else list(range(engines))
    model_bytes = sum(_weight_bytes(w, itemsize) for w in model.weights
                      if any(p.write for p in parts_of(engine, w)))
    per_gpu: dict[int, RankStats] = defaultdict(RankStats)
    per_engine, t0, pieces, written0 = [], time.perf_counter(), 0, None
    for e in ids:
        colocate = engine_colocate(e, engine.tp)
        plan = build_plan(model, train, engine, colocate=colocate)
        stats = plan_stats(plan, hw, bucket_bytes, itemsize)
        written = sum(s.written for s in stats.values())
        expect = sum(_numel(ref.shape) for ref in plan.dst_tensors.values()) * itemsize
        if written != expect:
            raise SimulationError(f"engine {e}: the plan writes {written} bytes but its destination tensors hold {expect}")
        if written0 is not None and written != written0:
            raise SimulationError(f"engine {e} writes {written} bytes, engine {ids[0]} {written0}: engines differ")
        written0, pieces = written, len(plan.pieces)
        for g, s in stats.items():
            per_gpu[g].add(s)
        per_engine.append({r: stats.get(colocate(r), RankStats()) for r in range(engine.tp)})
        del plan
    plan_seconds = time.perf_counter() - t0
    first = engine_colocate(ids[0], engine.tp)
    baseline = full_gather_stats(model, train, engine, ids[0], {first(r): s.written for r, s in per_engine[0].items()},
                                 hw, itemsize)
    return Report(model_bytes, written0, asdict(train), asdict(engine), len(ids), dict(per_gpu), per_engine,
                  baseline, plan_seconds, pieces, extra={"stage": {g: train.coords[g]["pp"] for g in per_gpu}})


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def summarize(rep: Report, hw: Hardware) -> dict:
    """The numbers the design note quotes: worst GPU per link, predicted sync times, and the baseline."""
    times = {g: link_times(s, hw) for g, s in rep.per_gpu.items()}
    worst = {k: max(times, key=lambda g: times[g][k]) for k in ("overlap", "serial", "ingress", "hbm", "nvlink", "ib")}
    e0 = rep.per_engine_rank[0]
    base = rep.baseline
    return {
        "engines_planned": rep.engines,
        "model_bytes": rep.model_bytes,
        "engine_written_bytes": rep.engine_written,
        "engine_weights_per_gpu_max": max(s.written for s in e0.values()),
        "pieces_per_engine": rep.pieces_per_engine,
        "plan_seconds": rep.plan_seconds,
        "predicted_s": {k: times[worst[k]][k] for k in ("overlap", "serial", "ingress")},
        "worst_gpu": {k: (g, times[g][k]) for k, g in worst.items()},
        "max_sent_bytes": max(s.sent for s in rep.per_gpu.values()),
        "max_recv_bytes": max(s.received for s in rep.per_gpu.values()),
        "max_launches": max(s.launches for s in rep.per_gpu.values()),
        "engine0": {r: dict(asdict(s), **{"t_" + k: v for k, v in link_times(s, hw).items()}) for r, s in e0.items()},
        "baseline_s": {"ingress": max(b["times"]["ingress"] for b in base.values()),
                       "with_loader": max(b["times"]["with_loader"] for b in base.values())},
        "baseline_recv_ib_max": max(b["recv_ib"] for b in base.values()),
        "baseline_tensors": next(iter(base.values()))["tensors"],
    }


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}"


def format_report(rep: Report, summary: dict, hw: Hardware, bucket_bytes: int) -> str:
    lines = [f"training {rep.train} -> {rep.engines} engine(s) {rep.engine}; bucket {bucket_bytes >> 20} MiB",
             f"model bytes seen by the engine (full, bf16): {_gb(rep.model_bytes)} GB; one engine writes "
             f"{_gb(rep.engine_written)} GB over its ranks (replicated weights once per rank); "
             f"max per engine GPU {_gb(summary['engine_weights_per_gpu_max'])} GB",
             f"planned {rep.engines} engine(s) in {rep.plan_seconds:.1f} s; {rep.pieces_per_engine} pieces per engine",
             "", "engine 0, per engine rank (GB; launches; buckets):",
             " rank  gpu  written  local  recv_nvl  recv_ib  sent_nvl  sent_ib  pieces  launches  buckets  t_overlap_s"]
    for r, s in sorted(rep.per_engine_rank[0].items()):
        g = engine_colocate(0, rep.engine["tp"])(r) if rep.engines else r
        t = link_times(s, hw)
        lines.append(f" {r:4d} {g:4d} {_gb(s.written):>8} {_gb(s.local):>6} {_gb(s.recv_nvlink):>9} {_gb(s.recv_ib):>8} "
                     f"{_gb(s.sent_nvlink):>9} {_gb(s.sent_ib):>8} {s.pieces_local + s.pieces_recv:7d} "
                     f"{s.launches:9d} {s.buckets:8d} {t['overlap']:11.3f}")
    lines += ["", f"per training pipeline stage, summed over {rep.engines} engine(s) (max over the stage's GPUs):",
              " stage  gpus  sent_GB  recv_GB  local_GB  pieces_sent  launches  t_overlap_s  t_ingress_s"]
    by_stage: dict[int, list[int]] = defaultdict(list)
    for g, st in rep.extra.get("stage", {}).items():
        by_stage[st].append(g)
    for st, gs in sorted(by_stage.items()):
        ss = [rep.per_gpu[g] for g in gs]
        ts = [link_times(x, hw) for x in ss]
        lines.append(f" {st:5d} {len(gs):5d} {max(x.sent for x in ss) / 1e9:8.2f} {max(x.received for x in ss) / 1e9:8.2f} "
                     f"{max(x.local for x in ss) / 1e9:9.2f} {max(x.pieces_sent for x in ss):12d} "
                     f"{max(x.launches for x in ss):9d} {max(t['overlap'] for t in ts):12.3f} "
                     f"{max(t['ingress'] for t in ts):12.3f}")
    lines += ["", f"all {len(rep.per_gpu)} GPUs, summed over {rep.engines} engine(s):"]
    for k, (g, v) in summary["worst_gpu"].items():
        s = rep.per_gpu[g]
        lines.append(f"  worst {k:8s} gpu {g:4d}: {v:8.3f} s (sent {_gb(s.sent)} GB, received {_gb(s.received)} GB, "
                     f"{s.launches} launches)")
    p, b = summary["predicted_s"], summary["baseline_s"]
    lines += ["", f"predicted sync: {p['overlap']:.3f} s overlapped, {p['serial']:.3f} s serial, "
                  f"{p['ingress']:.3f} s ingress-bound (relay)",
              f"full-gather baseline: {b['ingress']:.3f} s ingress-bound, {b['with_loader']:.3f} s with SGLang's "
              f"per-tensor loader cost ({summary['baseline_tensors']} tensors); max IB ingress "
              f"{_gb(summary['baseline_recv_ib_max'])} GB per GPU"]
    return "\n".join(lines)


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that choose the job and the links (also read by mtrain.reshard.simulate_delta)."""
    ap.add_argument("--config", default="deepseek_v3", help=f"one of {', '.join(CONFIGS)} or a config.json path")
    ap.add_argument("--train", default="tp=1,pp=16,ep=32", help="tp,pp,ep,etp,cp,dp[,first,last] (uneven PP)")
    ap.add_argument("--engine", default="tp=8,ep=8", help="engine tp,ep")
    ap.add_argument("--world", type=int, default=512, help="training GPUs (dp = world / (tp*pp*cp))")
    ap.add_argument("--engines", type=int, default=None, help="engines to plan (default: world / engine tp)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--hbm-tbps", type=float, default=4.2, help="measured HBM read+write bandwidth, TB/s")
    ap.add_argument("--nvlink-gbps", type=float, default=450.0, help="NVLink GB/s per direction per GPU")
    ap.add_argument("--ib-gbitps", type=float, default=400.0, help="InfiniBand Gb/s per GPU")
    ap.add_argument("--gpus-per-node", type=int, default=8)


def simulate_from_args(a: argparse.Namespace) -> tuple[Report, Hardware]:
    """Plan the job the add_plan_arguments options name; SimulationError / LayoutError name a bad option."""
    path = CONFIGS.get(a.config, Path(a.config))
    if not Path(path).is_file():
        raise SimulationError(f"--config {a.config!r}: no such config (known: {', '.join(CONFIGS)})")
    cfg = json.loads(Path(path).read_text())
    train = training_layout(cfg, parse_sizes(a.train, "train", ("tp", "pp", "ep", "etp", "cp", "dp",
                                                                "first", "last")), a.world)
    es = parse_sizes(a.engine, "engine", ("tp", "ep"))
    engine = SGLangLayout(tp=es.get("tp", 1), ep=es.get("ep", 1))
    hw = Hardware(gpus_per_node=a.gpus_per_node, hbm_bw=a.hbm_tbps * 1e12, nvlink_bw=a.nvlink_gbps * 1e9,
                  ib_bw=a.ib_gbitps * 1e9 / 8)
    return simulate(cfg, train, engine, engines=a.engines, hw=hw, bucket_bytes=a.bucket_mb << 20), hw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtrain.reshard.simulate", description=__doc__.split("\n")[0])
    add_plan_arguments(ap)
    ap.add_argument("--json", default=None, help="write the summary and per-GPU stats here")
    a = ap.parse_args(argv)
    try:
        rep, hw = simulate_from_args(a)
    except (SimulationError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(rep, hw)
    print(format_report(rep, summary, hw, a.bucket_mb << 20))
    if a.json:
        out = dict(summary, per_gpu={g: asdict(s) for g, s in rep.per_gpu.items()}, hardware=asdict(hw))
        tmp = Path(a.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
