"""The data and reward sections of a run's config (`data`, `reward`), split from mtrain.config_sections, which
assembles them into `RunConfig`: the generated tasks' settings, the dataset fields, and the reward function with its
LLM judge."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ArithmeticTaskConfig:
    num_train: int = 1024
    num_eval: int = 128
    max_operand: int = 50
    num_operands: int = 2
    ops: str = "+"  # any of "+-*"; with several operands, standard precedence applies


@dataclass
class LongtailTaskConfig:
    """'Count from 1 to N', N log-normal: heavy-tailed response lengths (mtrain/data/longtail.py)."""
    num_train: int = 1024
    num_eval: int = 64
    median_count: int = 20
    sigma: float = 1.0
    max_count: int = 400


@dataclass
class CountShapesTaskConfig:
    """'How many red shapes are in the image?' over generated pictures (mtrain/data/count_shapes.py)."""
    num_train: int = 1024
    num_eval: int = 64
    min_size: int = 56  # image width and height in pixels, each drawn from [min_size, max_size]
    max_size: int = 112
    max_shapes: int = 6


@dataclass
class DataConfig:
    train_path: str | None = None  # .jsonl / .json / .parquet, or a HF dataset folder (save_to_disk, hub parquet shards)
    train_split: str = "train"  # the split of a HF dataset folder (mtrain/data/hf_datasets.py)
    eval_split: str = "test"
    eval_path: str | None = None
    prompt_key: str = "prompt"  # dotted paths reach into nested records, e.g. "extra.question"
    answer_key: str = "answer"  # e.g. "reward_model.ground_truth" for verl-style parquet
    apply_chat_template: bool = True
    system_prompt: str | None = None
    drop_overlong_prompts: bool = False  # False: a prompt longer than rollout.max_prompt_len is an error
    task: Literal["arithmetic", "longtail", "count_shapes"] | None = None  # a generated task, not train/eval_path
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    longtail: LongtailTaskConfig = field(default_factory=LongtailTaskConfig)
    count_shapes: CountShapesTaskConfig = field(default_factory=CountShapesTaskConfig)
    # Vision models (docs/design-vlm-data.md): a record's image paths (relative to its file; `<image>` in the prompt
    # marks each) and the pixel budget per image: the processor resizes within it, and an image with more pixels is
    # an error before the run starts (None: the model's preprocessor_config.json max_pixels).
    image_key: str = "images"
    max_pixels: int | None = None
    shuffle: bool = True
    seed: int = 0


DEFAULT_JUDGE_TEMPLATE = ("Question: {prompt}\nReference answer: {answer}\nStudent answer: {response}\n"
                          "Is the student answer correct? Reply yes or no.\nVerdict:")


@dataclass
class JudgeConfig:
    """An LLM judge served on an engine of its own (mtrain/rollout/judge.py, docs/design-judge.md): its weights are
    read once from hf_path and never synced; its tokens are never trained."""
    hf_path: str | None = None  # the judge model (HF dir with config.json); None = no judge
    # {prompt} {response} {answer} are filled in; {response} is required; other braces are kept as written
    template: str = DEFAULT_JUDGE_TEMPLATE
    parser: Literal["yes_no", "score", "regex"] = "yes_no"  # how the verdict text becomes a reward in [0, 1]
    pattern: str | None = None  # parser=regex: a pattern with one group holding a number (the reward)
    score_max: float = 10.0  # parser=score: the verdict's top score; reward = score / score_max, clipped to [0, 1]
    combine: Literal["judge", "sum"] = "judge"  # judge: the verdict is the reward; sum: reward.fn's + weight * verdict
    weight: float = 1.0
    batch_size: int = 32  # judge requests submitted together
    timeout_s: float = 60.0  # per judge call: past it the call is aborted, counted, and rewarded 0
    max_new_tokens: int = 16  # the verdict's length
    apply_chat_template: bool = False  # true: the filled template is one user turn of the judge's chat template
    max_prompt_len: int = 2048  # judge prompts longer than this (tokens) are not sent: counted, rewarded 0
    mem_fraction_static: float = 0.1  # SGLang only: the judge engine's share of its GPU


@dataclass
class RewardConfig:
    fn: str = "mtrain.data.rewards:exact_match_reward"  # "module:function" or "path/to/file.py:function"
    timeout_s: float | None = None  # per call; None = no limit
    judge: JudgeConfig = field(default_factory=JudgeConfig)
