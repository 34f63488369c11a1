"""Prompt datasets, chat templates, generated tasks, reward functions and the resumable sampler."""
from mtrain.data.arithmetic import TaskError, evaluate, make_arithmetic_splits
from mtrain.data.chat import PromptError, TokenizedPrompt, render_prompt, tokenize_prompts
from mtrain.data.datasets import DatasetError, PromptSample, load_prompts
from mtrain.data.rewards import (RewardError, exact_match_reward, extract_answer, load_reward_fn,
                                 normalize_answer, safe_reward, score_responses)
from mtrain.data.sampler import PromptSampler, SamplerStateError
from mtrain.data.tiny_tokenizer import CharTokenizer

__all__ = [
    "TaskError", "evaluate", "make_arithmetic_splits", "PromptError", "TokenizedPrompt", "render_prompt",
    "tokenize_prompts", "DatasetError", "PromptSample", "load_prompts", "RewardError", "exact_match_reward",
    "extract_answer", "load_reward_fn", "normalize_answer", "safe_reward", "score_responses", "PromptSampler",
    "SamplerStateError", "CharTokenizer", "load_datasets",
]


def load_datasets(cfg) -> tuple[list[PromptSample], list[PromptSample]]:
    """(train, eval) samples for a RunConfig's `data` section; eval is [] when none is configured."""
    d = cfg.data
    if d.task == "arithmetic":
        a = d.arithmetic
        return make_arithmetic_splits(a.num_train, a.num_eval, seed=d.seed, max_operand=a.max_operand,
                                      num_operands=a.num_operands, ops=a.ops)
    if d.task == "count_shapes":
        from mtrain.data.count_shapes import make_count_shapes_splits
        from mtrain.data.vision import check_samples, pixel_budget
        c = d.count_shapes
        train, evals = make_count_shapes_splits(c.num_train, c.num_eval, seed=d.seed, min_size=c.min_size,
                                                max_size=c.max_size, max_shapes=c.max_shapes)
        check_samples(train + evals, pixel_budget(cfg))
        return train, evals
    if d.task == "longtail":
        from mtrain.data.longtail import make_longtail_splits
        t = d.longtail
        return make_longtail_splits(t.num_train, t.num_eval, seed=d.seed, median_count=t.median_count, sigma=t.sigma,
                                    max_count=t.max_count)
    from mtrain.data.vision import pixel_budget
    budget = pixel_budget(cfg)
    train = load_prompts(d.train_path, d.prompt_key, d.answer_key, image_key=d.image_key, max_pixels=budget,
                         split=d.train_split)
    try:
        evals = load_prompts(d.eval_path, d.prompt_key, d.answer_key, image_key=d.image_key,
                             max_pixels=budget, split=d.eval_split) if d.eval_path else []
    except DatasetError as e:
        e.key = "data.eval_path"
        raise
    return train, evals
