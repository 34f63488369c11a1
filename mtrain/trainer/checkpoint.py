"""Checkpoints for exact resume: model + optimizer (Megatron dist checkpoint), LR schedule, RNG, data position.

Layout of RUN_DIR/checkpoints/step_{N}/: `mcore/` (torch_dist), `trainer_state.pt` (rank 0: step, sampler,
scheduler, weight version, RNG), `rng_rank{r}.pt` (every rank's RNG) and `COMPLETE` written last. A step
directory without COMPLETE is a half-written checkpoint and is never loaded; `latest` names the newest
complete one and is replaced atomically, so a crash at any point keeps the last good checkpoint.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


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


def _sharded(actor, is_loading: bool) -> dict:
    model_sd = {}
    for i, c in enumerate(actor.chunks):
        model_sd[f"model{i}"] = c.sharded_state_dict()
    flat = {}
    for sd in model_sd.values():
        flat.update(sd)
    opt = actor.optimizer.sharded_state_dict(flat, is_loading=is_loading,
                                             metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return {**model_sd, "optimizer": opt}


def save(run_dir: str | Path, step: int, actor, trainer_state: dict) -> Path:
    from megatron.core import dist_checkpointing
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    rank = dist.get_rank()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        (final / "mcore").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(actor, is_loading=False), str(final / "mcore"))
    torch.save(_rng_state(), final / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        torch.save({**trainer_state, "scheduler": actor.scheduler.state_dict(), "step": step},
                   final / "trainer_state.pt")
        (final / "COMPLETE").write_text(str(step))
        tmp = root / f".latest.{os.getpid()}"
        tmp.write_text(final.name)
        os.replace(tmp, root / "latest")
    dist.barrier()
    return final


def find_latest(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    latest = root / "latest"
    if not latest.exists():
        return None
    path = root / latest.read_text().strip()
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{latest} names {path}, which is not a complete checkpoint")
    return path


def load(path: str | Path, actor) -> dict:
    """Restore model, optimizer, scheduler and RNG from a complete checkpoint; return the trainer state."""
    from megatron.core import dist_checkpointing
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker): refusing to load it")
    state = dist_checkpointing.load(_sharded(actor, is_loading=True), str(path / "mcore"))
    for i, c in enumerate(actor.chunks):
        c.load_state_dict(state[f"model{i}"])
    actor.optimizer.load_state_dict(state["optimizer"])
    trainer = torch.load(path / "trainer_state.pt", weights_only=False)
    actor.scheduler.load_state_dict(trainer.pop("scheduler"))
    _set_rng_state(torch.load(path / f"rng_rank{dist.get_rank()}.pt", weights_only=False))
    return trainer
