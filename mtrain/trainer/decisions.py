"""The run's machine-dependent decisions, made once from the config and the machine, then passed down.

Nothing else in the trainer asks `torch.cuda.is_available()` or whether Transformer Engine imports: the loop, the
actor, the engines and the sync read these fields. `decide` is pure given its inputs (tests pass `cuda`/`te`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain.config import ConfigError
from mtrain.engine_args import refuse_on_reference_engine
from mtrain.rollout.groups import EngineGroups, EngineLayoutError
from mtrain.trainer.publishers.colocated import sync_mode


@dataclass(frozen=True)
class RunDecisions:
    device: str  # "cuda" | "cpu": where training tensors live
    engine_kind: str  # "sglang" | "reference"
    engine_layout: str  # what the sync writes: "sglang" (SGLang's parameters) | "hf" (the reference engine's)
    groups: EngineGroups
    colocate: bool  # engines give their GPU memory back while training runs (release/resume around the update)
    offload_train: bool  # gradients and optimizer state go to host memory while the engines generate
    sequence_parallel: bool
    use_te: bool
    sync_mode: str  # "pull" | "push"
    engine_fp8: bool = False  # engine.weight_dtype=fp8: FP8 engine weights, quantized by the sync (docs/fp8.md)
    fp8_scaling: str = "block"  # engine.fp8_scaling resolved for the model and engine: "block" | "channel"
    engine_dtype: torch.dtype = torch.float32  # what engines compute in and the sync writes (RunConfig.engine_dtype)

    def summary(self) -> str:
        return (f"device={self.device} engine={self.engine_kind} sync={self.sync_mode} colocate={self.colocate} "
                f"offload_train={self.offload_train} sequence_parallel={self.sequence_parallel} te={self.use_te} "
                f"fp8_engine={self.fp8_scaling if self.engine_fp8 else False} engine_dtype={str(self.engine_dtype).removeprefix('torch.')}\n"
                f"{self.groups.describe()}")


def engine_kind(engine_cfg, cuda: bool) -> str:
    """engine.kind as the run resolves it: auto is SGLang where a GPU is, the CPU reference engine elsewhere."""
    return engine_cfg.kind if engine_cfg.kind != "auto" else ("sglang" if cuda else "reference")


def fp8_scaling(cfg, hf_config: dict | None, kind: str) -> str:
    """engine.fp8_scaling resolved (reshard.planner.resolve_fp8_scaling) for the engine the run starts: SGLang's at
    engine.tp / engine.ep; the reference engine emulates the model's whole tensors, SGLang's engine TP 1. Without
    the model's config (no hf_config) auto means block. Refused here, before any engine or trainer work."""
    e = cfg.engine
    if e.weight_dtype != "fp8":
        return "block"
    if hf_config is None:
        return "block" if e.fp8_scaling == "auto" else e.fp8_scaling
    from mtrain.layouts import LayoutError, model_layout
    from mtrain.reshard.planner import resolve_fp8_scaling
    tp, ep = (e.tp, e.ep) if kind == "sglang" else (1, 1)
    try:
        return resolve_fp8_scaling(model_layout(dict(hf_config, num_nextn_predict_layers=0), mtp=False),
                                   e.fp8_scaling, tp, ep)
    except LayoutError as err:
        raise ConfigError(f"engine.weight_dtype=fp8: {err}") from None


def decide(cfg, *, world_size: int, local_world_size: int, cuda: bool | None = None,
           te: bool | None = None, hf_config: dict | None = None) -> RunDecisions:
    if cuda is None:
        cuda = torch.cuda.is_available()
    if te is None:
        from mtrain.models.specs import te_available
        te = te_available()
    e, p = cfg.engine, cfg.parallel
    kind = engine_kind(e, cuda)
    if kind == "sglang" and not cuda:
        raise ConfigError("engine.kind: sglang needs a GPU (none here); use engine.kind=reference or auto")
    try:
        if e.placement == "separate":  # engines on the last engine.ranks ranks only (mtrain/job_split.py)
            from mtrain.rollout.separate_groups import SeparateGroups
            groups = SeparateGroups(world_size, world_size - e.ranks, e.tp, local_world_size)
            bad = groups.straddling() if kind == "sglang" else None
            if bad is not None:
                raise EngineLayoutError(f"engine {bad} (ranks {groups.ranks(bad)}) lies on two nodes of "
                                        f"{local_world_size} ranks; an SGLang engine's ranks share one node: choose "
                                        "engine.ranks and engine.tp so that no engine crosses a node boundary")
        else:
            groups = EngineGroups(world_size, e.tp, local_world_size, e.nnodes)
    except EngineLayoutError as err:
        raise ConfigError(f"engine.tp / engine.nnodes: {err}") from None
    if kind == "reference":  # engine.kind=auto on a CPU-only machine: engine.server_args would go unread
        refuse_on_reference_engine(e.server_args)
    if kind == "reference" and e.nnodes > 1:
        raise ConfigError("engine.nnodes > 1 is for SGLang engines spanning nodes; the reference engine is one "
                          "process")
    sp = p.sequence_parallel
    if sp is None:  # the default: on where it works and helps (TE norms, TP > 1)
        sp = te and p.tp > 1
    elif sp and not te:
        raise ConfigError("parallel.sequence_parallel: true needs Transformer Engine (megatron-core's local norm "
                          "refuses sequence parallelism); leave it unset or false")
    elif sp and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel: true needs parallel.tp > 1")
    return RunDecisions(device="cuda" if cuda else "cpu", engine_kind=kind,
                        engine_layout="hf" if kind == "reference" else "sglang", groups=groups,
                        # rollout.async: engines generate while training runs, so they stay resident
                        colocate=e.colocate and cfg.rollout.async_mode == "off",
                        offload_train=e.offload_train, sequence_parallel=sp, use_te=te,
                        sync_mode=sync_mode(cfg.sync.mode), engine_fp8=e.weight_dtype == "fp8",
                        fp8_scaling=fp8_scaling(cfg, hf_config, kind),
                        engine_dtype=getattr(torch, cfg.engine_dtype))
