"""Checkpoints for exact resume: model + optimizer (Megatron dist checkpoint), LR schedule, RNG, data position.

Layout of RUN_DIR/checkpoints/step_{N}/: `mcore/` (torch_dist), `trainer_state.pt` (rank 0: step, sampler,
scheduler, weight version, RNG), `rng_rank{r}.pt` (every rank's RNG) and `COMPLETE` written last. A step
directory without COMPLETE is a half-written checkpoint and is never loaded; `latest` names the newest
complete one and is replaced atomically, so a crash at any point keeps the last good checkpoint. A checkpoint
is written under `.partial_step_{N}/` and renamed into place when complete.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mtrain.run_files import CHECKPOINTS


class CheckpointError(RuntimeError):
    pass




def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(s: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    get_cuda_rng_tracker().set_states(s["tracker"])


def _sharded(actor, is_loading: bool, optimizer_format: str) -> dict:
    from megatron.core.utils import unwrap_model
    # The bare GPTModel's keys (as Megatron's own checkpointing does): the DDP wrapper would prefix every key
    # with "module." and then refuse its own state on load; bare keys also make a run's checkpoint usable
    # as model.mcore_ckpt.
    model_sd = {}
    for i, c in enumerate(unwrap_model(actor.chunks)):
        model_sd[f"model{i}"] = c.sharded_state_dict()
    flat = {}
    for sd in model_sd.values():
        flat.update(sd)
    # fully_reshardable (train.optimizer_checkpoint's default): Adam's moments and main params are saved in model
    # space (each parameter's logical shape, sharded like the parameter), so a resume may use another TP/PP/DP
    # layout; saving gathers each data-parallel group's state in host memory. dp_reshardable: each rank's flat
    # shard, no gather, same TP/PP layout only. Adam's step count travels in trainer_state.pt either way.
    opt = _checkpointed_optimizer(actor.optimizer).sharded_state_dict(
        flat, is_loading=is_loading, metadata={"distrib_optim_sharding_type": optimizer_format})
    return {**model_sd, "optimizer": opt}


def save(run_dir: str | Path, step: int, actor, trainer_state: dict, extra: dict | None = None) -> Path:
    """Write into `.partial_step_{N}`, then rename to `step_{N}` once every file and COMPLETE are there:
    a crash at any point leaves no step directory that looks like a checkpoint. extra: further trained models by
    name (PPO's critic), each saved like the policy into `{name}/` with its schedule and Adam steps."""
    from megatron.core import dist_checkpointing
    root = Path(run_dir) / CHECKPOINTS
    final, part = root / f"step_{step}", root / f".partial_step_{step}"
    rank = dist.get_rank()
    if rank == 0:
        if part.exists():  # left by a run that died while saving this step
            shutil.rmtree(part)
        (part / "mcore").mkdir(parents=True)
    dist.barrier()
    fmt = actor.cfg.train.optimizer_checkpoint
    _allocate_optimizer_state(actor, for_save=True)  # the policy waits through critic.warmup_steps
    dist_checkpointing.save(_sharded(actor, is_loading=False, optimizer_format=fmt), str(part / "mcore"))
    for name, other in (extra or {}).items():
        _allocate_optimizer_state(other, for_save=True)  # zeros at step 0 = a fresh Adam, for a model not stepped yet
        if rank == 0:
            (part / name).mkdir()
        dist.barrier()
        dist_checkpointing.save(_sharded(other, is_loading=False, optimizer_format=fmt), str(part / name))
    torch.save(_rng_state(), part / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0 and getattr(actor, "lora", None) is not None:  # what export-lora and a resume need to rebuild it
        from mtrain.layouts.lora import write_meta
        write_meta(part / "mcore", actor.lora_spec)
    if rank == 0:
        others = {name: {"scheduler": o.scheduler.state_dict(), "adam_steps": _adam_steps(o)}
                  for name, o in (extra or {}).items()}
        torch.save({**trainer_state, "scheduler": actor.scheduler.state_dict(), "step": step,
                    "adam_steps": _adam_steps(actor), "layout": current_layout(), "optimizer_format": fmt,
                    **({"extra_models": others} if others else {})}, part / "trainer_state.pt")
        (part / "COMPLETE").write_text(str(step))
        if final.exists():  # an older save of this step (a run resumed from before it): replace it
            shutil.rmtree(final)
        os.replace(part, final)
        point_latest(root, final.name)
        prune_checkpoints(root, actor.cfg.train.keep_checkpoints)
    dist.barrier()
    return final


def point_latest(root: Path, name: str) -> None:
    """`latest` names `name`, replaced atomically: a reader finds the old name or the new, never half of one."""
    tmp = root / f".latest.{os.getpid()}"
    tmp.write_text(name)
    os.replace(tmp, root / "latest")


def entry_step(name: str) -> int | None:
    """The step of an entry of RUN_DIR/checkpoints (step_N, or .partial_step_N: a save of step N that did not finish),
    else None (`latest`, a user's own file)."""
    rest = name[len(".partial_"):] if name.startswith(".partial_") else name
    return int(rest[5:]) if rest.startswith("step_") and rest[5:].isdigit() else None


def saved_step(path: str | Path) -> int | None:
    """The step a complete checkpoint was saved at, from its COMPLETE marker (save writes the step there), without
    loading anything; None when the marker holds no step."""
    try:
        text = (Path(path) / "COMPLETE").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def prune_checkpoints(root: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (train.keep_checkpoints; None keeps all). Runs after
    `latest` points at the new one, so a crash mid-delete leaves at least the newest intact; a checkpoint without
    COMPLETE (or a .partial_ save) is never counted as one of the kept ones and never deleted here."""
    if keep is None:
        return []
    steps = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "COMPLETE").is_file()),
                   key=lambda p: int(p.name[5:]))
    old = steps[:-keep] if keep > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def save_without_model(run_dir: str | Path, step: int, extra: tuple[str, ...] = ()) -> None:
    """`save` on a rank that holds no part of the model (engine.placement=separate: the engine ranks).

    megatron-core's dist_checkpointing (0.16.1) takes no process group: its barriers, its sharding-validation
    gathers and torch.distributed.checkpoint's save planning all run over the default group, which spans the whole
    job. So this rank enters exactly the collectives `save` enters, in the same order, with an empty sharded state
    dict (it contributes no shard and writes no file); the training ranks write the model, the optimizer and, on
    rank 0 (a training rank), trainer_state.pt and COMPLETE. extra: the names of the training ranks' further models
    (PPO's critic), whose saves this rank joins the same way."""
    from megatron.core import dist_checkpointing
    part = Path(run_dir) / CHECKPOINTS / f".partial_step_{step}"
    dist.barrier()
    with _quiet_common_check():
        dist_checkpointing.save({}, str(part / "mcore"))
        for name in extra:
            dist.barrier()
            dist_checkpointing.save({}, str(part / name))
    dist.barrier()
    dist.barrier()


def load_without_model(path: str | Path, extra: tuple[str, ...] = ()) -> dict:
    """`load` on a rank that holds no part of the model (see save_without_model): the same collectives, nothing
    loaded; returns the trainer state (step, sampler) rank 0 saved."""
    from megatron.core import dist_checkpointing
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker): refusing to load it")
    left_out = torch.zeros(())
    dist.all_reduce(left_out, op=dist.ReduceOp.MAX)  # _refuse_partial_optimizer's vote: this rank has no optimizer
    if left_out.item():
        raise CheckpointError("resuming needs the same optimizer structure on every pipeline stage (a training "
                              "rank's message says which)")
    dist_checkpointing.load({}, str(path / "mcore"))
    for name in extra:  # the training ranks' further models (save_without_model's extra), in the same order
        dist_checkpointing.load({}, str(path / name))
    return torch.load(path / "trainer_state.pt", weights_only=False)


class _quiet_common_check:
    """dist_checkpointing.save compares every rank's common (non-sharded) state with rank 0's and warns on a
    difference; a rank without a model has none by design, so its warning says nothing."""

    def __enter__(self):
        import logging
        self._log = logging.getLogger("megatron.core.dist_checkpointing.validation")
        self._level = self._log.level
        self._log.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._log.setLevel(self._level)


def _intact_torch_file(f: Path) -> bool:
    """torch.save writes a zip archive: its directory at the end and each entry's CRC find a file cut short or
    overwritten, which torch.load would only report after the models are built. The files are small (KBs)."""
    import zipfile
    try:
        with zipfile.ZipFile(f) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` cannot be resumed from (one sentence), or None when it is complete and intact: the COMPLETE
    marker, the trainer state, every rank's RNG file, and the dist checkpoint with every shard present at the size
    its index needs (the converters' check, `check_dist_checkpoint`)."""
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.mcore_io import check_dist_checkpoint
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a checkpoint directory"
    if not (path / "COMPLETE").is_file():
        return f"{path} has no COMPLETE marker (a save that did not finish)"
    if not (path / "trainer_state.pt").is_file():
        return f"{path}: trainer_state.pt is missing"
    if not (path / "rng_rank0.pt").is_file():
        return f"{path}: rng_rank0.pt is missing"
    for f in (path / "trainer_state.pt", *sorted(path.glob("rng_rank*.pt"))):
        if not _intact_torch_file(f):
            return f"{f}: cut short or damaged (not a readable torch.save file)"
    try:
        check_dist_checkpoint(path / "mcore", need_config=False)
    except ConvertError as e:
        return str(e)
    return None


def resume_path(resume: str, run_dir: str | Path, report=print) -> Path | None:
    """The checkpoint train.resume names: none for "never", the newest loadable one in run_dir for "auto" (find_latest,
    `report` as there), else the path given. The trainer loads it; preflight checks it holds the run's model."""
    if resume == "never":
        return None
    return find_latest(run_dir, report) if resume == "auto" else Path(resume)


def find_latest(run_dir: str | Path, report=print) -> Path | None:
    """The intact checkpoint with the highest step, or None. Directories are scanned rather than trusting
    `latest` alone: a kill between the rename and the pointer update leaves `latest` one save behind. A newer
    checkpoint that is damaged (a shard deleted or cut short, a half-written save) is skipped, and `report`
    says which and why, so that resume falls back to the newest one that can be loaded."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    steps = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: -int(p.name[5:]))
    if report is not None:
        for p in sorted(root.glob(".partial_step_*")):
            report(f"resume: ignoring {p.name}: a save that was interrupted (removed by the next save of that step)")
    for p in steps:
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        if report is not None:
            report(f"resume: skipping {p.name}: {problem}")
    return None


def _checkpointed_optimizer(optimizer):
    """The optimizer whose state a checkpoint holds: without the chained sub-optimizers that own no parameters.

    megatron-core 0.16.1 builds an expert-parallel optimizer with no parameters on a pipeline stage without MoE
    layers (DeepSeek-V3's first stage: dense layers only), and without Apex/TE its state_dict asserts on the
    empty Adam state (`assert len(steps) == 1`). It has nothing to save; leaving it out on save and on load
    keeps the save working; its ranks' optimizer state is complete. Resuming from such a checkpoint is refused
    by load(): rank 0's common (non-sharded) optimizer state then has another structure than the MoE stages'.
    With Apex/TE megatron-core takes another branch and nothing is left out."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE
    subs = getattr(optimizer, "chained_optimizers", None)
    if not subs or HAVE_APEX_OR_TE:
        return optimizer
    keep = [s for s in subs if _owns_params(s)]
    return optimizer if len(keep) == len(subs) else ChainedOptimizer(keep)


def _owns_params(sub) -> bool:
    return any(len(g["params"]) for g in getattr(sub, "optimizer", sub).param_groups)


def _inner_optimizers(optimizer) -> list:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def _optimizer_classes(actor) -> list:
    out = []
    for opt in _inner_optimizers(actor.optimizer):
        for key in ("cpu_optimizer_cls", "gpu_optimizer_cls"):
            cls = opt.defaults.get(key)
            if isinstance(cls, type) and cls not in out:
                out.append(cls)
    return out


def _allocate_optimizer_state(actor, for_save: bool = False) -> None:
    """Give every parameter Adam state (zeros, step 0) before a load, as a first optimizer step would.

    Megatron's distributed optimizer reads the inner torch Adam's `step` to build the state dict it loads
    into; without Apex/TE a fresh optimizer has no state at all and that read fails (`assert len(steps) == 1`).
    Every value written here is overwritten by the checkpoint's.

    optim.cpu_offload (megatron-core's HybridDeviceOptimizer) needs its own: its load hooks copy every state's
    `master_param` into the host fp32 copies the CPU Adam steps (KeyError without one), and its state must sit in
    its sub-optimizers too. Its public `dummy_step` (documented for exactly this: checkpoint loading into an
    empty optimizer) makes that state with one Adam step on random gradients; the bf16 parameter shards it
    changes are overwritten by the checkpoint's model weights before the optimizer state is loaded.
    """
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    for opt in _inner_optimizers(actor.optimizer):
        if isinstance(opt, HybridDeviceOptimizer):
            if not opt.state and for_save:  # dummy_step would change the weights being saved
                raise CheckpointError("a save before the model's first optimizer step (critic.warmup_steps) is not "
                                      "supported with optim.cpu_offload: save after the warm-up")
            if not opt.state:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if hasattr(p, "decoupled_grad"):  # a gradient from an earlier step would be used instead
                            del p.decoupled_grad
                opt.dummy_step()
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                st.setdefault("exp_avg", torch.zeros_like(p.data))
                st.setdefault("exp_avg_sq", torch.zeros_like(p.data))
                st.setdefault("step", torch.zeros((), dtype=torch.float32))


def _adam_steps(actor) -> list[float]:
    """Each inner Adam's update count (one value per optimizer: all its parameters step together)."""
    out = []
    for opt in _inner_optimizers(actor.optimizer):
        steps = {float(st["step"]) for st in opt.state.values() if "step" in st}
        if len(steps) > 1:
            raise CheckpointError(f"optimizer parameters disagree on Adam's step count: {sorted(steps)}")
        out.append(steps.pop() if steps else 0.0)
    return out


def _set_adam_steps(actor, steps: list[float]) -> None:
    """Restore Adam's step counts. Megatron's load does not (without Apex/TE it leaves 0 here, and where it does
    set them it hands every parameter the SAME tensor, which torch's Adam then increments once per parameter)."""
    opts = _inner_optimizers(actor.optimizer)
    if len(steps) != len(opts):
        raise CheckpointError(f"checkpoint has Adam step counts for {len(steps)} optimizers, this run builds "
                              f"{len(opts)}: the model or parallel layout differs from the saved run")
    for opt, step in zip(opts, steps):
        for st in opt.state.values():
            st["step"] = torch.tensor(step, dtype=torch.float32)  # one tensor per parameter


def _refuse_partial_optimizer(actor) -> None:
    """One clear error (on every rank) instead of megatron's 'Expected 2 entries in state dict' when a
    stage's optimizer was saved without its empty expert optimizer (_checkpointed_optimizer)."""
    opt = actor.optimizer
    left_out = torch.tensor(float(_checkpointed_optimizer(opt) is not opt))
    dist.all_reduce(left_out, op=dist.ReduceOp.MAX)
    if left_out.item():
        raise CheckpointError("resuming needs the same optimizer structure on every pipeline stage, but a stage "
                              "without MoE layers has an empty expert optimizer, which megatron-core (without "
                              "Apex/Transformer Engine) cannot checkpoint; the checkpoint's model weights export "
                              "fine (mtrain-convert mcore-to-hf); to resume, put an MoE layer on every stage "
                              "(parallel.first_stage_layers) or install Apex/Transformer Engine")


@torch.no_grad()  # optimizer state is copied into main params that are views of trainable leaves
def load(path: str | Path, actor, extra: dict | None = None) -> dict:
    """Restore model, optimizer, scheduler and RNG from a complete checkpoint; return the trainer state.
    extra: the further trained models saved with it (save's extra), restored the same way."""
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker): refusing to load it")
    _refuse_partial_optimizer(actor)
    trainer = torch.load(path / "trainer_state.pt", weights_only=False)
    fmt = trainer.pop("optimizer_format", "dp_reshardable")  # checkpoints from before the format was recorded
    saved, now = trainer.pop("layout", None), current_layout()
    if fmt == "dp_reshardable" and saved is not None and saved != now:
        raise CheckpointError(
            f"{path}: optimizer state saved as dp_reshardable at {_layout_text(saved)} cannot be loaded at "
            f"{_layout_text(now)}: resume with that layout, or start from its weights with "
            f"model.mcore_ckpt={path / 'mcore'} in another train.run_dir (Adam's state restarts)")
    n_saved, n_now = len(trainer["adam_steps"]), len(_inner_optimizers(actor.optimizer))
    if n_saved != n_now:  # e.g. a MoE model whose expert parameters get an optimizer of their own at one layout
        raise CheckpointError(
            f"{path}: optimizer state saved for {n_saved} optimizer(s) at {_layout_text(saved or {})} but this run "
            f"builds {n_now} at {_layout_text(now)} (not supported yet): resume with that layout, or start from its "
            f"weights with model.mcore_ckpt={path / 'mcore'} in another train.run_dir (Adam's state restarts)")
    saved_extra = trainer.pop("extra_models", {})
    for name in extra or {}:
        if name not in saved_extra:
            raise CheckpointError(f"{path} holds no {name} (written by a run without it): resume with the same "
                                  f"algorithm, or start a new train.run_dir")
    _load_model_and_optimizer(path / "mcore", actor, fmt, trainer.pop("scheduler"), trainer.pop("adam_steps"))
    for name, other in (extra or {}).items():
        _load_model_and_optimizer(path / name, other, fmt, saved_extra[name]["scheduler"],
                                  saved_extra[name]["adam_steps"])
    if saved is None or saved == now:
        _set_rng_state(torch.load(path / f"rng_rank{dist.get_rank()}.pt", weights_only=False))
    elif dist.get_rank() == 0:
        # Another layout: model and optimizer were resharded on load. Per-rank RNG streams belong to the old
        # ranks' places; they restart from train.seed (rollout sampling seeds come from the step, not from them).
        change = ", ".join(f"{k} {saved.get(k)}->{v}" for k, v in now.items() if saved.get(k) != v)
        print(f"resume: checkpoint written at another parallel layout ({change}): model and optimizer state "
              "resharded; RNG streams restart from train.seed", flush=True)
    return trainer


def _load_model_and_optimizer(mcore: Path, actor, fmt: str, scheduler: dict, adam_steps: list) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    _allocate_optimizer_state(actor)
    # optim.cpu_offload: the hybrid optimizer's param groups carry its sub-optimizer classes (cpu_optimizer_cls,
    # gpu_optimizer_cls), which megatron saves in its common state (common.pt up to 0.16, inside the shards from
    # 0.19) and reads with torch.load with weights_only (torch's default), refusing them. Allowed here: exactly the
    # classes this run's own optimizers use.
    with torch.serialization.safe_globals(_optimizer_classes(actor)):
        state = dist_checkpointing.load(_sharded(actor, is_loading=True, optimizer_format=fmt), str(mcore))
    for i, c in enumerate(unwrap_model(actor.chunks)):
        c.load_state_dict(state[f"model{i}"])
    _load_optimizer(_checkpointed_optimizer(actor.optimizer), state["optimizer"])
    actor.scheduler.load_state_dict(scheduler)
    _set_adam_steps(actor, adam_steps)


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def current_layout() -> dict[str, int]:
    """The parallel layout a checkpoint was written at (saved with it; a resume compares)."""
    from megatron.core import parallel_state as ps
    return {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def _load_optimizer(optimizer, state) -> None:
    """Megatron's optimizer load, with the fully_reshardable parameter state loaded in a second call.

    Megatron 0.16.1 copies a fully_reshardable state into every key of the inner optimizer's per-parameter state,
    which for torch's Adam (no Apex/TE) includes `step`, a key that format does not carry: KeyError. So: load the
    common part (param groups, which allocates the state), drop `step` from the per-parameter state, load the
    parameter state through the same public method Megatron would call, and let `_set_adam_steps` put the saved
    counts back. Formats without that gap load in one call as before."""
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is None or len(subs) == 1:
        pairs = [((subs or [optimizer])[0], state)]
    else:
        parts = [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state)
        pairs = list(zip(subs, parts))
    for sub, st in pairs:
        if not (isinstance(st, dict) and st.get("param_state_sharding_type") == "fully_reshardable"):
            sub.load_state_dict(st)
            continue
        param_state = st.pop("param_state")
        st.pop("param_state_sharding_type")
        sub.load_state_dict(st)
        for per_param in sub.optimizer.state.values():
            per_param.pop("step", None)
        sub.load_parameter_state_from_fully_reshardable(param_state)
