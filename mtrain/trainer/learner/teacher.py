"""On-policy distillation in the loop: a frozen teacher scores the student's sampled tokens.

The teacher is a second frozen Megatron model (Actor(trainable=False), like the KL reference) built from
algo.distill.teacher_path under the policy's own layout (parallel.*), so its logprobs land on the same last
pipeline stage, rows and [B, T-1] positions as the student's. Config checks (config_checks.check_teacher) have
already refused a teacher with another vocabulary or tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mtrain.algorithms.distill import distill_advantages
from mtrain.layouts import model_layout
from mtrain.trainer.learner.actor import Actor
from mtrain.trainer.engines import weight_loader
from mtrain.trainer.learner.offload import TrainOffload


def build_teacher(cfg, rank: int, overrides: dict) -> Actor | None:
    """The frozen teacher, or None without algo.distill.teacher_path."""
    path = cfg.algo.distill.teacher_path
    if not path:
        return None
    hf_config = dict(json.loads((Path(path) / "config.json").read_text()), num_nextn_predict_layers=0)
    # the teacher's weights come from its own HF dir (never the policy's model.mcore_ckpt)
    teacher_cfg = _with_model(cfg, path)
    load = weight_loader(teacher_cfg, model_layout(hf_config, mtp=False), rank)
    return Actor(teacher_cfg, hf_config, load_weights=load, trainable=False, overrides=overrides)


def _with_model(cfg, hf_path: str):
    import copy
    out = copy.copy(cfg)
    out.model = copy.copy(cfg.model)
    out.model.hf_path, out.model.mcore_ckpt = hf_path, None
    return out


class TeacherOffload(TrainOffload):
    """The frozen teacher has no gradients or optimizer state: its parameters are what leaves the device (no engine
    reads them, unlike the policy's)."""

    def storages(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for c in self.actor.chunks:
            for p in c.parameters():
                if p.numel():
                    found.setdefault(p.untyped_storage().data_ptr(), p)
        return list(found.values())


class Distiller:
    """Adds the distillation term to each minibatch's advantages and keeps the step's token-weighted metric.
    offload (engine.offload_train): the teacher's weights stay in host memory except during its scoring passes."""

    def __init__(self, cfg, teacher: Actor, offload: bool = False):
        dc = cfg.algo.distill
        self.teacher = teacher
        self.offload = TeacherOffload(teacher, offload)
        self.offload.offload()
        self.coef = 1.0 if dc.coef is None else dc.coef
        self.only = bool(dc.only)
        self.kl_sum = self.tokens = 0.0

    def advantages(self, mb, adv: torch.Tensor, student_lp: torch.Tensor | None) -> torch.Tensor:
        """adv - coef * (student_lp - teacher_lp) on this minibatch's model tokens (or -coef * (...) alone).
        Logprobs exist on the last pipeline stage only: elsewhere the advantages are not read and pass as they are.
        The teacher's forward runs on every stage (its pipeline needs each stage)."""
        self.offload.reload()  # no-op unless offloaded
        teacher_lp = self.teacher.logprobs(mb)
        if student_lp is None or teacher_lp is None:
            return adv
        mask = mb.response_mask.bool()
        out, metrics = distill_advantages(adv, student_lp, teacher_lp, mask, coef=self.coef, only=self.only)
        n = float(mask.sum())
        self.kl_sum += float(metrics["distill/reverse_kl"]) * n
        self.tokens += n
        return out

    def metrics(self) -> dict[str, float]:
        """This rank's step metric (mean over its model tokens), then reset for the next step. Called after the
        step's last scoring pass: the teacher leaves the device here until the next step's."""
        out = {"distill/reverse_kl": self.kl_sum / self.tokens} if self.tokens else {}
        moved = self.offload.offload().get("offload/bytes")
        if moved is not None:
            out["distill/offload_bytes"] = moved
        self.kl_sum = self.tokens = 0.0
        return out
