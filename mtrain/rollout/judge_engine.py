"""The run's reward function, with the judge of `reward.judge` when one is named: its engine started here, loaded
from reward.judge.hf_path (its own weights, never the policy's, never synced), on the run's engine kind.

The trainer's one call: `make_reward_fn(cfg, engine_kind=decisions.engine_kind, engine_dtype=decisions.engine_dtype)`
where it loaded reward.fn before; with no judge it returns exactly `load_reward_fn(cfg.reward.fn)`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mtrain.data.rewards import RewardFn, load_reward_fn
from mtrain.rollout.judge import JudgeReward
from mtrain.rollout.judge_verdict import make_parser
from mtrain.tokenizer_files import TOKENIZER_FILES


def load_judge_tokenizer(hf_dir: str | Path) -> Any:
    """The judge's HF tokenizer; a tiny random model without tokenizer files gets the character tokenizer."""
    hf_dir = Path(hf_dir)
    if any((hf_dir / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(hf_dir))
    import json

    from mtrain.data.tiny_tokenizer import CharTokenizer
    return CharTokenizer(vocab_size=json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def start_judge_engine(hf_path: str, *, engine_kind: str, engine_dtype: Any, mem_fraction_static: float,
                       seed: int = 0, base_gpu_id: int | None = None):
    """The judge's engine, weights loaded from its checkpoint: the CPU reference engine, or an SGLang engine of
    its own (tp 1) sharing this rank's GPU with the policy's engine at `mem_fraction_static`."""
    if engine_kind == "reference":
        from mtrain.rollout.reference_engine import ReferenceEngine
        return ReferenceEngine.from_pretrained(hf_path, dtype=engine_dtype)
    from mtrain.rollout.sglang_engine import SGLangEngine
    gpu = int(os.environ.get("LOCAL_RANK", 0)) if base_gpu_id is None else base_gpu_id
    dtype = engine_dtype if isinstance(engine_dtype, str) else str(engine_dtype).removeprefix("torch.")
    return SGLangEngine(hf_path, tp_size=1, base_gpu_id=gpu, mem_fraction_static=mem_fraction_static,
                        random_seed=seed, server_args={"dtype": dtype})


def make_judge(cfg, engine, tokenizer, base_fn: RewardFn | None = None) -> JudgeReward:
    """A JudgeReward on a started engine, configured from cfg.reward (and reward.fn as base_fn for combine=sum)."""
    j = cfg.reward.judge
    return JudgeReward(engine, tokenizer, template=j.template,
                       parser=make_parser(j.parser, score_max=j.score_max, pattern=j.pattern),
                       batch_size=j.batch_size, timeout_s=j.timeout_s, max_new_tokens=j.max_new_tokens,
                       max_prompt_len=j.max_prompt_len, combine=j.combine, weight=j.weight,
                       base_fn=base_fn if j.combine == "sum" else None, base_timeout_s=cfg.reward.timeout_s,
                       chat=j.apply_chat_template)


def make_reward_fn(cfg, *, engine_kind: str, engine_dtype: Any) -> RewardFn:
    """reward.fn, or the judge of reward.judge (started now) when reward.judge.hf_path is set."""
    base = load_reward_fn(cfg.reward.fn)
    j = cfg.reward.judge
    if j.hf_path is None:
        return base
    engine = start_judge_engine(j.hf_path, engine_kind=engine_kind, engine_dtype=engine_dtype,
                                mem_fraction_static=j.mem_fraction_static, seed=cfg.train.seed)
    return make_judge(cfg, engine, load_judge_tokenizer(j.hf_path), base)
