"""Preflight of the models beside the policy (before any process group starts): PPO's critic and the
distillation teacher must fit the run's parallel layout, and the teacher must speak the policy's tokenizer."""
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


def _vocab(tokenizer) -> dict:
    get = getattr(tokenizer, "get_vocab", None)
    return get() if get is not None else {"<chars>": getattr(tokenizer, "vocab_size", None)}


def check_side_models(cfg: RunConfig, hf_config: dict, dp: int) -> None:
    if cfg.algo.name == "ppo":
        path = cfg.critic.hf_path or cfg.model.hf_path
        _fits("critic.hf_path", cfg, _hf_config("critic.hf_path", path) if cfg.critic.hf_path else hf_config, dp)
    teacher = cfg.algo.distill.teacher_path
    if teacher is None:
        return
    key = "algo.distill.teacher_path"
    t_config = _hf_config(key, teacher)
    _fits(key, cfg, t_config, dp)
    from mtrain.models.hf_config import map_hf_config
    vs, vt = map_hf_config(hf_config).vocab_size, map_hf_config(t_config).vocab_size
    if vs != vt:
        raise ConfigError(f"{key}: the teacher's vocabulary has {vt} entries, the policy's {vs}: distillation "
                          f"scores the student's token ids, so both need the same tokenizer")
    from mtrain.trainer.engines import load_tokenizer
    if _vocab(load_tokenizer(Path(teacher), t_config)) != _vocab(load_tokenizer(Path(cfg.model.hf_path), hf_config)):
        raise ConfigError(f"{key}: the teacher's tokenizer maps tokens to other ids than the policy's "
                          f"({cfg.model.hf_path}): distillation needs the same tokenizer")
