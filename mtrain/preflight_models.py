"""Preflight of the models beside the policy (before any process group starts): PPO's critic and the
distillation teacher must fit the run's parallel layout."""
from __future__ import annotations

import json
from pathlib import Path

from mtrain.config import ConfigError, RunConfig


def _hf_config(key: str, path: str) -> dict:
    f = Path(path) / "config.json"
    try:
        out = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {f} is unreadable: {e}") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{key}: {f} must hold a JSON object")
    return out


def _fits(key: str, cfg: RunConfig, hf_config: dict, dp: int) -> None:
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.mcore_io import layout_for
    from mtrain.layouts import LayoutError
    from mtrain.models.hf_config import ModelConfigError
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    p = cfg.parallel
    try:
        model = layout_for(hf_config, mtp=False)
        build_plan(model, HFLayout(), MegatronLayout(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, dp=dp,
                                                     first_stage_layers=p.first_stage_layers,
                                                     last_stage_layers=p.last_stage_layers))
    except (ConvertError, ModelConfigError) as e:
        raise ConfigError(f"{key}: {e}") from None
    except LayoutError as e:
        raise ConfigError(f"{key}: the model does not fit the run's layout tp={p.tp} pp={p.pp} ep={p.ep} cp={p.cp} "
                          f"(dp={dp}): {e}") from None


def check_side_models(cfg: RunConfig, hf_config: dict, dp: int) -> None:
    """The vocabulary and tokenizer of the teacher are config_checks.check_teacher's (with the paths)."""
    if cfg.algo.name == "ppo":
        critic = hf_config if cfg.critic.hf_path is None else _hf_config("critic.hf_path", cfg.critic.hf_path)
        _fits("critic.hf_path", cfg, critic, dp)
    if cfg.algo.distill.teacher_path:
        key = "algo.distill.teacher_path"
        _fits(key, cfg, _hf_config(key, cfg.algo.distill.teacher_path), dp)
