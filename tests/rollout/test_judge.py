"""The LLM judge (mtrain/rollout/judge.py): its verdict pipeline end to end on the CPU reference engine holding a tiny
random judge model, checked against an independent greedy decode of the same checkpoint; failed calls (timeout,
engine refusal, too long, unparseable) rewarded 0 and counted, never raised; bad reward.judge config refused in one
line before any engine starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtrain.config import ConfigError, load_config
from mtrain.data.records import PromptSample
from mtrain.data.rewards import exact_match_reward, score_responses
from mtrain.rollout.judge import JudgeReward, render
from mtrain.rollout.judge_engine import load_judge_tokenizer, make_judge, make_reward_fn
from mtrain.rollout.judge_verdict import make_parser
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.tiny_configs import tiny_config
from mtrain.tiny_hf import write_tiny_hf

BASE = ["model.hf_path=/models/tiny", "data.task=arithmetic"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "judge" / "grpo_judge.yaml"
TEMPLATE = "Q: {prompt} A: {answer} R: {response} Score:"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    # initializer_range 1.0: varied enough text that the digit parser finds verdicts in some answers, not in others
    return write_tiny_hf("llama", tmp_path_factory.mktemp("judge") / "hf", seed=0,
                         overrides={"max_position_embeddings": 512, "initializer_range": 1.0})


def samples_and_responses():
    samples = [PromptSample(index=0, prompt="2+3=?", answer="5"),
               PromptSample(index=1, prompt=[{"role": "user", "content": "7*6=?"}], answer="42")]
    responses = ["5", "the answer is 41", "{answer} 42", "", "99 99 99"]
    return [samples[0], samples[0], samples[1], samples[1], samples[1]], responses


def greedy_reference(hf_dir, tokenizer, prompts_ids, max_new_tokens):
    """The verdicts written from scratch: HF's model from the checkpoint, full forward each step (no cache), argmax,
    stop after eos; decoded as the judge decodes."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float64).eval()
    out = []
    for ids in prompts_ids:
        gen = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                nxt = int(model(input_ids=torch.tensor([ids + gen])).logits[0, -1].argmax())
                gen.append(nxt)
                if nxt == tokenizer.eos_token_id:
                    break
        out.append(tokenizer.decode(gen, skip_special_tokens=True))
    return out


@pytest.mark.parametrize("parser, pattern, chat", [("regex", r"([0-9])", False), ("regex", r"(.)", False),
                                                   ("regex", r"([0-9])", True),
                                                   ("score", None, False), ("yes_no", None, False)])
def test_verdicts_from_the_reference_engine_match_an_independent_decode(judge_dir, parser, pattern, chat):
    over = [f"reward.judge.hf_path={judge_dir}", f"reward.judge.template={TEMPLATE}", f"reward.judge.parser={parser}",
            "reward.judge.batch_size=2", "reward.judge.max_new_tokens=12",
            f"reward.judge.apply_chat_template={str(chat).lower()}"]
    cfg = load_config(None, BASE + over + ([f"reward.judge.pattern={pattern}"] if pattern else []))
    judge = make_reward_fn(cfg, engine_kind="reference", engine_dtype=torch.float32)
    try:
        assert isinstance(judge, JudgeReward)
        samples, responses = samples_and_responses()
        rewards = score_responses(judge, samples, responses)
        texts = [render(TEMPLATE, s.prompt, r, s.answer) for s, r in zip(samples, responses)]
        assert texts[2] == "Q: 7*6=? A: 42 R: {answer} 42 Score:"  # chat prompt's user turn; response braces kept
        tok = judge.tokenizer  # the char tokenizer (no tokenizer files): its chat turn is "user: ...\nassistant:"
        ids = [tok.encode(f"<bos>user: {t}\nassistant:" if chat else t, add_special_tokens=not chat) for t in texts]
        assert [judge.encode(t) for t in texts] == ids
        expected_verdicts = greedy_reference(judge_dir, tok, ids, 12)
        assert judge.last_verdicts == expected_verdicts
        parse = make_parser(parser, pattern=pattern, score_max=10.0)
        expected = [parse(v) for v in expected_verdicts]
        assert rewards == [0.0 if e is None else e for e in expected]
        if parser != "yes_no":  # this checkpoint writes digits in some verdicts: real rewards, not all zeros
            assert any(e is not None and e > 0 for e in expected)
        if pattern != r"([0-9])":  # ... and verdicts these parsers cannot read (counted below)
            assert None in expected
        assert all(type(r) is float and 0.0 <= r <= 1.0 for r in rewards)  # floats only: no judge token leaves
        m = judge.pop_metrics()
        assert m["judge/calls"] == 5 and m["judge/unparsed"] == sum(e is None for e in expected)
        assert m["judge/timeouts"] == m["judge/errors"] == m["judge/too_long"] == 0
        assert m["judge/mean_verdict"] == pytest.approx(sum(rewards) / 5)
        assert judge.pop_metrics()["judge/calls"] == 0  # counters reset per step
        assert judge.engine.weight_version == 0  # loaded once from its checkpoint; nothing synced into it
        # one response at a time (multi-turn rollouts call the reward this way): the same verdict
        assert judge(responses[1], "5", prompt="2+3=?") == rewards[1]
    finally:
        judge.shutdown()


def test_sum_combines_reward_fn_and_weighted_verdict(judge_dir):
    cfg = load_config(None, BASE + [f"reward.judge.hf_path={judge_dir}", "reward.judge.combine=sum",
                                    "reward.judge.weight=0.5", "reward.judge.parser=regex",
                                    r"reward.judge.pattern=(.)", f"reward.judge.template={TEMPLATE}"])
    engine = ReferenceEngine.from_pretrained(str(judge_dir))
    judge = make_judge(cfg, engine, load_judge_tokenizer(judge_dir), exact_match_reward)
    try:
        samples, responses = samples_and_responses()
        got = score_responses(judge, samples, responses)
        verdicts = judge.judge([s.prompt for s in samples], responses, [s.answer for s in samples])
        base = [exact_match_reward(r, s.answer) for s, r in zip(samples, responses)]
        assert base[0] == 1.0 and got == [b + 0.5 * v for b, v in zip(base, verdicts)]
    finally:
        engine.shutdown()


def _judge_on(engine, tokenizer, **kw):
    return JudgeReward(engine, tokenizer, template=TEMPLATE, parser=make_parser("yes_no"), **kw)


def test_timeouts_are_aborted_counted_and_rewarded_zero(judge_dir):
    cfg = tiny_config("llama", max_position_embeddings=512)
    engine = ReferenceEngine(cfg, decode_delay_s=0.5)  # every decoding step takes 0.5 s
    tok = load_judge_tokenizer(judge_dir)
    judge = _judge_on(engine, tok, timeout_s=0.3, max_new_tokens=8, batch_size=4)
    try:
        samples, responses = samples_and_responses()
        assert score_responses(judge, samples, responses) == [0.0] * 5
        m = judge.pop_metrics()
        assert m["judge/timeouts"] == 5 and m["judge/calls"] == 5
        assert "reward.judge.timeout_s=0.3" in judge.last_errors[0]
    finally:
        engine.shutdown()


def test_engine_refusals_and_long_prompts_are_counted_not_raised(judge_dir):
    engine = ReferenceEngine(tiny_config("llama", max_position_embeddings=48))
    tok = load_judge_tokenizer(judge_dir)
    judge = _judge_on(engine, tok, max_new_tokens=8, max_prompt_len=60)
    try:
        prompts, answers = ["1+1=?"] * 3, ["2"] * 3
        responses = ["2", "x" * 20, "y" * 200]  # fits; engine refuses (> 48 positions); over max_prompt_len
        rewards = judge.judge(prompts, responses, answers)
        m = judge.pop_metrics()
        assert rewards[1:] == [0.0, 0.0]
        assert (m["judge/errors"], m["judge/too_long"], m["judge/calls"]) == (1, 1, 3)
        assert rewards[0] == (make_parser("yes_no")(judge.last_verdicts[0]) or 0.0)
        assert judge.last_verdicts[1:] == ["", ""]
        assert any("max_position_embeddings" in e for e in judge.last_errors)
        assert any("reward.judge.max_prompt_len=60" in e for e in judge.last_errors)
    finally:
        engine.shutdown()


def test_without_a_judge_the_reward_is_reward_fn():
    cfg = load_config(None, BASE)
    assert make_reward_fn(cfg, engine_kind="reference", engine_dtype=torch.float32) is exact_match_reward


@pytest.mark.parametrize("override, message", [
    ("reward.judge.hf_path=/nonexistent/judge", "reward.judge.hf_path: '/nonexistent/judge' is not a HF model dir"),
    ("reward.judge.hf_path=", "reward.judge.hf_path: is empty: the judge's HF model dir, or null for no judge"),
    ("reward.judge.template=Rate {prompt}", "reward.judge.template: must contain {response}"),
    ("reward.judge.timeout_s=0", "reward.judge.timeout_s: must be a finite number > 0, got 0"),
    ("reward.judge.timeout_s=-5", "reward.judge.timeout_s: must be a finite number > 0, got -5"),
    ("reward.judge.timeout_s=nan", "reward.judge.timeout_s: must be a finite number > 0"),
    ("reward.judge.timeout_s=soon", "reward.judge.timeout_s: expected float"),
    ("reward.judge.batch_size=0", "reward.judge.batch_size: must be >= 1"),
    ("reward.judge.parser=regex", "reward.judge.pattern: parser=regex needs a pattern"),
    ("reward.judge.parser=stars", "reward.judge.parser: 'stars' is not one of"),
])
def test_bad_judge_config_is_one_line_before_work(judge_dir, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [f"reward.judge.hf_path={judge_dir}", override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("pattern, message", [("([0-9]", "not a valid regular expression"),
                                              ("[0-9]", "has 0 groups"), ("(a)(b)", "has 2 groups")])
def test_bad_regex_patterns_are_refused(judge_dir, pattern, message):
    with pytest.raises(ConfigError, match="reward.judge.pattern") as e:
        load_config(None, BASE + [f"reward.judge.hf_path={judge_dir}", "reward.judge.parser=regex",
                                  f"reward.judge.pattern={pattern}"])
    assert message in str(e.value)


def test_the_example_config_loads_and_builds_its_judge(judge_dir):
    cfg = load_config(str(EXAMPLE), [f"model.hf_path={judge_dir}", f"reward.judge.hf_path={judge_dir}"])
    j = cfg.reward.judge
    assert (j.parser, j.combine, j.apply_chat_template) == ("yes_no", "judge", True)
    engine = ReferenceEngine.from_pretrained(str(judge_dir))
    try:
        judge = make_judge(cfg, engine, load_judge_tokenizer(judge_dir))
        assert judge.chat and judge.timeout_s == 60 and judge.max_new_tokens == 4 and judge.base_fn is None
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="reward.judge.hf_path: is empty"):  # the example needs its judge
        load_config(str(EXAMPLE), [f"model.hf_path={judge_dir}"])


def test_a_judge_engine_that_is_gone_gives_counted_errors(judge_dir):
    engine = ReferenceEngine(tiny_config("llama", max_position_embeddings=512))
    judge = _judge_on(engine, load_judge_tokenizer(judge_dir), max_new_tokens=4)
    engine.shutdown()
    assert judge.judge(["1+1=?"] * 2, ["2", "3"], ["2"] * 2) == [0.0, 0.0]
    assert judge.pop_metrics()["judge/errors"] == 2 and "shut down" in judge.last_errors[0]
