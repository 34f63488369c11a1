"""Preflight of the models beside the policy (before any process group starts): PPO's critic and the
distillation teacher must fit the run's parallel layout."""
from __future__ import annotations

from pathlib import Path

from mtrain.config import ConfigError, RunConfig
from mtrain.config_checks import read_config_json


def _fits(key: str, cfg: RunConfig, hf_config: dict, dp: int) -> None:
    from mtrain.converters.errors import ConvertError
    from mtrain.converters.mcore_io import layout_for
    from mtrain.layouts import LayoutError
    from mtrain.models.hf_config import ModelConfigError, map_hf_config
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    p = cfg.parallel
    try:
        map_hf_config(hf_config)  # names a missing required field; the layout tables would raise KeyError
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
        critic = hf_config if cfg.critic.hf_path is None else read_config_json(cfg.critic.hf_path, "critic.hf_path")
        _fits("critic.hf_path", cfg, critic, dp)
    if cfg.algo.distill.teacher_path:
        key = "algo.distill.teacher_path"
        _fits(key, cfg, read_config_json(cfg.algo.distill.teacher_path, key), dp)


# the keys that name a HF model folder (each may be a hub id: mtrain/hub_models.py)
MODEL_PATH_KEYS = (("model", "hf_path"), ("critic", "hf_path"), ("algo.distill", "teacher_path"))


def resolve_model_sources(cfg: RunConfig) -> None:
    """Replace every hub id among the model paths by its local snapshot folder (downloading it once)."""
    from mtrain.hub_models import HubModelError, looks_like_hub_id, rank0_report, resolve_hub_id
    for section, attr in MODEL_PATH_KEYS:
        obj = cfg
        for part in section.split("."):
            obj = getattr(obj, part)
        value = getattr(obj, attr)
        if value and looks_like_hub_id(str(value)):
            try:
                setattr(obj, attr, resolve_hub_id(str(value), report=rank0_report))
            except HubModelError as e:
                raise ConfigError(f"{section}.{attr}: {e}") from None


def check_tokenizer(cfg: RunConfig) -> None:
    """The policy folder has a tokenizer, or is marked as a random model for the character tokenizer: a real model
    read through the character tokenizer trains on garbage without any error (its answers are noise, eval 0)."""
    from mtrain.tokenizer_files import CHAR_TOKENIZER_MARKER, TOKENIZER_FILES, tokenizer_files, uses_char_tokenizer
    hf = Path(cfg.model.hf_path)
    if tokenizer_files(hf) or uses_char_tokenizer(hf):
        return
    raise ConfigError(
        f"model.hf_path: {hf} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy them from where the "
        f"weights came from (the model's Hugging Face repository, or the folder you converted from: `mtrain-convert "
        f"gguf-to-hf` writes them), or give the hub id (model.hf_path=ORG/NAME); a random test model made by "
        f"`mtrain init-tiny` carries {CHAR_TOKENIZER_MARKER} instead")


# what renders every prompt through the tokenizer's chat template: the config key that asks for it
TEMPLATE_USERS = (("data.apply_chat_template", lambda cfg: cfg.data.apply_chat_template),
                  # the built-in tool rollouts: token-in-token-out appends each turn through the template
                  ("multi_turn.rollout_fn", lambda cfg: (cfg.multi_turn.rollout_fn or "").endswith(
                      "mtrain.rollout.agents.multi_turn:rollout_group")),
                  ("serve.agent", lambda cfg: bool(cfg.serve.agent)))  # the OpenAI front renders every chat call


def tokenizer_loader(cfg: RunConfig, hf_config: dict):
    """A call that returns the policy's tokenizer as the trainer loads it, read from disk at the first call only (the
    chat-template and prompt-context checks both need it: a real tokenizer takes seconds to load)."""
    import functools

    from mtrain.tokenizer_files import tokenizer_files

    @functools.cache
    def tokenizer():
        from mtrain.trainer.engines import load_tokenizer
        hf = Path(cfg.model.hf_path)
        try:
            return load_tokenizer(hf, hf_config, max_pixels=cfg.data.max_pixels)
        except (OSError, ValueError) as e:  # transformers' own message, on several lines
            raise ConfigError(f"model.hf_path: the tokenizer files in {hf} ({', '.join(tokenizer_files(hf))}) do "
                              f"not load ({' '.join(str(e).split())}): copy the model's complete tokenizer from "
                              f"where the weights came from") from None
    return tokenizer


def check_chat_template(cfg: RunConfig, hf_config: dict, tokenizer) -> None:
    """A tokenizer without a chat template, where the run renders prompts through one (TEMPLATE_USERS). Without this
    the run built its models and engines, started step 1 and stopped there: a PromptError per rank for
    data.apply_chat_template, a transformers ValueError traceback per rank for tool rollouts and agents. tokenizer:
    tokenizer_loader's call."""
    from mtrain.tokenizer_files import tokenizer_files
    hf = Path(cfg.model.hf_path)
    users = [key for key, uses in TEMPLATE_USERS if uses(cfg)]
    if not users or hf_config.get("vision_config") or not tokenizer_files(hf):
        return  # a vision model's processor renders its own template; the character tokenizer has one
    if getattr(tokenizer(), "chat_template", None):
        return
    fix = ("set data.apply_chat_template=false to use plain text prompts, or add"
           if users == ["data.apply_chat_template"] else "add")
    raise ConfigError(f"{users[0]}: renders prompts through the tokenizer's chat template, and the tokenizer in {hf} "
                      f"has none; {fix} the model's chat template (chat_template.jinja, or chat_template in "
                      f"tokenizer_config.json)")


def finished_run(cfg: RunConfig) -> str | None:
    """The line to print instead of starting a run that is already complete (train.resume=auto finds a checkpoint at
    train.steps or later), or None. Every rank decides alike from the same files, before any process group."""
    if cfg.train.resume != "auto" or cfg.train.val_only:
        return None
    from mtrain.trainer.checkpoint import find_latest
    latest = find_latest(cfg.train.run_dir, report=None)
    if latest is None or int(latest.name[5:]) < cfg.train.steps:
        return None
    run = cfg.train.run_dir
    return (f"mtrain: {run} is already trained to train.steps={cfg.train.steps} (checkpoints/{latest.name}): nothing "
            f"to do. Raise train.steps to go on, or pick another train.run_dir; plot with: mtrain plot {run}")


def check_reward_fn(cfg: RunConfig) -> None:
    """reward.fn imports and takes (response, answer): said before any process group, not after the model loads."""
    from mtrain.data.rewards import RewardError, load_reward_fn
    try:
        load_reward_fn(cfg.reward.fn)
    except RewardError as e:
        raise ConfigError(f"reward.fn: {e}") from None
