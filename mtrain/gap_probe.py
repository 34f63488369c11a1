"""`mtrain gap-probe CONFIG [a.b=c ...]`: where the engine-vs-trainer logprob gap of a model comes from.

One token sequence (a prompt of the config's data plus a continuation the engine samples at the rollout's
temperature, like a rollout token) goes through three models built from the same weights:
    trainer    the run's Megatron-core model (model.dtype, model.fp32_lm_head, ...), as `mtrain train` builds it
    engine     the run's rollout engine (engine.kind, engine.server_args, ...) after the run's own first sync
    reference  HF transformers in float64 (--reference-dtype) on the CPU: the arithmetic both approximate
The residual stream and every sublayer output are captured at the same points in all three (mtrain/models/taps.py;
inside SGLang's schedulers through mtrain/rollout/sglang_taps.py) and compared as relative L2 differences,
||a - b|| / ||reference||, point by point in forward order; then the next-token logprobs (temperature 1) of
the sampled continuation. Where trainer-vs-engine first grows, and which side is off the reference there,
names the part to look at; running it again with one engine or model setting changed measures that setting.

It runs as one process at TP/PP/EP/CP 1 and engine TP 1 (whatever the config says) so that the two sides'
differences are the kernels' and dtypes', not a parallel layout's. The sequence must fit one SGLang prefill
chunk (chunked_prefill_size).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from mtrain.config import ConfigError, load_config

ONE_PROCESS = ("parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.ep=1", "parallel.etp=null",
               "parallel.cp=1", "engine.tp=1", "engine.ep=1", "engine.nnodes=1", "engine.placement=colocated",
               "engine.ranks=null", "train.resume=never", "train.log_wandb=false", "train.log_tensorboard=false",
               "algo.kl_coef=0")


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def _reference(hf_dir: str, dtype: torch.dtype, ids: torch.Tensor) -> dict[str, Any]:
    """The HF model in `dtype` on the CPU, built from its config and filled from the safetensors (the CPU
    reference engine's loader: every weight must be present). Not `from_pretrained`: once the trainer is built
    in this process, transformers 5.12's from_pretrained left the rotary inv_freq buffer uninitialised."""
    from mtrain.rollout.reference_engine import ReferenceEngine
    engine = ReferenceEngine.from_pretrained(hf_dir, dtype=dtype)
    try:
        out = engine.probe_activations(ids.tolist())
    finally:
        engine.shutdown()
    return out


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return logp.gather(1, ids[1:, None].to(logp.device))[:, 0].cpu()


def compare(trainer: dict, engine: dict, reference: dict, continuation_from: int) -> dict[str, Any]:
    """The report: per point the three relative differences, then the logprob gaps over the continuation
    (positions predicting tokens continuation_from.. of the sequence) and over every position."""
    from mtrain.models.taps import point_order, rel_diff
    t, e, r = trainer["taps"], engine["taps"], reference["taps"]
    points = []
    for name in point_order(set(t) & set(e) & set(r)):
        if not (t[name].shape == e[name].shape == r[name].shape):
            continue
        points.append({"point": name, "trainer_vs_reference": rel_diff(t[name], r[name], r[name]),
                       "engine_vs_reference": rel_diff(e[name], r[name], r[name]),
                       "trainer_vs_engine": rel_diff(t[name], e[name], r[name])})
    lt, le, lr = (x["logprobs"].double() for x in (trainer, engine, reference))
    gaps = {}
    for span, sl in (("continuation", slice(continuation_from - 1, None)), ("all", slice(None))):
        for label, a, b in (("trainer_vs_engine", lt, le), ("trainer_vs_reference", lt, lr),
                            ("engine_vs_reference", le, lr)):
            d = (a[sl] - b[sl]).abs()
            gaps[f"{span}/{label}/mean"] = float(d.mean()) if d.numel() else 0.0
            gaps[f"{span}/{label}/max"] = float(d.max()) if d.numel() else 0.0
    return {"points": points, "logprob_gap": gaps, "missing_points": sorted((set(t) | set(e)) - set(r))}


def largest_step(points: list[dict]) -> dict | None:
    """The point where trainer-vs-engine grows most over the point before it (the first point: over zero)."""
    best, prev = None, 0.0
    for p in points:
        grow = p["trainer_vs_engine"] - prev
        if best is None or grow > best[0]:
            best = (grow, p)
        prev = p["trainer_vs_engine"]
    return None if best is None else dict(best[1], growth=best[0])


def format_report(report: dict) -> str:
    lines = [f"{'point':<10} {'trainer-ref':>12} {'engine-ref':>12} {'trainer-engine':>15}"]
    for p in report["points"]:
        lines.append(f"{p['point']:<10} {p['trainer_vs_reference']:>12.3e} {p['engine_vs_reference']:>12.3e} "
                     f"{p['trainer_vs_engine']:>15.3e}")
    g = report["logprob_gap"]
    lines.append("next-token logprob |difference| over the sampled continuation (mean / max):")
    for label in ("trainer_vs_engine", "trainer_vs_reference", "engine_vs_reference"):
        lines.append(f"  {label:<22} {g[f'continuation/{label}/mean']:.4g} / {g[f'continuation/{label}/max']:.4g}")
    step = largest_step(report["points"])
    if step is not None:
        side = "trainer" if step["trainer_vs_reference"] > step["engine_vs_reference"] else "engine"
        lines.append(f"trainer-engine grows most at {step['point']} (+{step['growth']:.3e}); there the {side} is "
                     f"further from the reference")
    return "\n".join(lines)


def gap_probe(cfg, *, record: int = 0, new_tokens: int = 32, reference_dtype: str = "float64") -> dict[str, Any]:
    from mtrain.data.chat import render_prompt
    from mtrain.models.forward import forward_logits
    from mtrain.models.taps import Taps, megatron_points
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        data = trainer.eval_set or trainer.train_set
        if not 0 <= record < len(data):
            raise ConfigError(f"--record {record}: the data has {len(data)} records")
        sample = data[record]
        _, prompt_ids = render_prompt(trainer.tokenizer, sample.prompt, apply_chat_template=cfg.data.apply_chat_template,
                                      system_prompt=cfg.data.system_prompt, sample_id=record)
        r = cfg.rollout
        params = SamplingParams(max_new_tokens=new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                seed=cfg.train.seed)
        done = trainer.engine.generate([Request(rid=uuid.uuid4().hex, prompt_ids=prompt_ids, params=params)])[0]
        ids = torch.tensor(prompt_ids + list(done.output_ids), dtype=torch.long)
        chunks = [_unwrap(c) for c in trainer.actor.chunks]  # GPTModels: Float16Module only casts float inputs
        with torch.no_grad(), Taps(megatron_points(chunks[0])) as taps:
            logits = forward_logits(chunks, ids[None].to(trainer.actor.device))
        vocab = trainer.actor.vocab
        side_t = {"taps": taps.captures, "logprobs": _next_token_logprobs(logits[0, :, :vocab], ids)}
        side_e = trainer.engine.probe_activations(ids.tolist())
    finally:
        trainer.close()
    side_r = _reference(cfg.model.hf_path, getattr(torch, reference_dtype), ids)
    report = compare(side_t, side_e, side_r, continuation_from=len(prompt_ids))
    report.update(tokens=len(ids), prompt_tokens=len(prompt_ids), engine=type(trainer.engine).__name__,
                  model_dtype=cfg.model.dtype, engine_dtype=cfg.engine_dtype, reference_dtype=reference_dtype)
    return report


def main(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("gap-probe runs as one process: start it without torchrun")
    run_dir = tempfile.mkdtemp(prefix="mtrain-gap-probe-")
    cfg = load_config(args.config, [*args.overrides, *ONE_PROCESS, f"train.run_dir={run_dir}"])
    report = gap_probe(cfg, record=args.record, new_tokens=args.new_tokens, reference_dtype=args.reference_dtype)
    print(format_report(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
