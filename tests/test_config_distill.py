"""algo.distill.*: one clear line before any work for a teacher that cannot score the policy's tokens."""
import json

import pytest

from mtrain.config import ConfigError, load_config


def model_dir(path, vocab=64, tokenizer=None):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
    if tokenizer is not None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(tokenizer)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return path


def load(policy, *overrides):
    return load_config(None, [f"model.hf_path={policy}", "data.task=arithmetic", *overrides], check_files=True)


WORDS = ["<unk>", "</s>", "a", "b", "c", "1", "2", "+"]


def test_distill_keys_without_a_teacher(tmp_path):
    policy = model_dir(tmp_path / "p")
    for key, value in (("coef", "0.5"), ("only", "true")):
        with pytest.raises(ConfigError, match=rf"^algo\.distill\.{key}: is set but algo\.distill\.teacher_path is "
                                              r"not"):
            load(policy, f"algo.distill.{key}={value}")
    with pytest.raises(ConfigError, match=r"^algo\.distill\.coef: must be > 0, got -1.0"):
        load(policy, f"algo.distill.teacher_path={policy}", "algo.distill.coef=-1")


def test_teacher_with_another_vocab_size(tmp_path):
    policy, teacher = model_dir(tmp_path / "p", 64), model_dir(tmp_path / "t", 128)
    with pytest.raises(ConfigError, match=r"^algo\.distill\.teacher_path: the teacher's vocab_size is 128, the "
                                          r"policy's .* is 64"):
        load(policy, f"algo.distill.teacher_path={teacher}")
    with pytest.raises(ConfigError, match=r"^algo\.distill\.teacher_path: .* is not a HF model dir"):
        load(policy, f"algo.distill.teacher_path={tmp_path / 'missing'}")


def test_unreadable_config_json_of_either_model(tmp_path):
    # json's JSONDecodeError traceback before; the key says which model's file it is
    policy, teacher = model_dir(tmp_path / "p"), model_dir(tmp_path / "t")
    (teacher / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^algo\.distill\.teacher_path: {teacher / 'config.json'} is unreadable: "):
        load(policy, f"algo.distill.teacher_path={teacher}")
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"^algo\.distill\.teacher_path: .*config\.json has no vocab_size"):
        load(policy, f"algo.distill.teacher_path={teacher}")
    (policy / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=rf"^model\.hf_path: {policy / 'config.json'} must hold a JSON object"):
        load(policy, f"algo.distill.teacher_path={teacher}")


def test_teacher_with_another_tokenizer(tmp_path):
    policy = model_dir(tmp_path / "p", tokenizer=WORDS)
    same = model_dir(tmp_path / "same", tokenizer=WORDS)
    cfg = load(policy, f"algo.distill.teacher_path={same}")
    assert cfg.algo.distill.teacher_path == str(same) and cfg.algo.distill.coef is None
    swapped = model_dir(tmp_path / "swapped", tokenizer=WORDS[:2] + ["b", "a"] + WORDS[4:])  # same words, other ids
    with pytest.raises(ConfigError, match=r"^algo\.distill\.teacher_path: the teacher's tokenizer differs from the "
                                          r"policy's: 4 \(token, id\) pairs"):
        load(policy, f"algo.distill.teacher_path={swapped}")
    none = model_dir(tmp_path / "none")  # character tokenizer
    with pytest.raises(ConfigError, match=r"^algo\.distill\.teacher_path: the policy's tokenizer files are .*, the "
                                          r"teacher's none"):
        load(policy, f"algo.distill.teacher_path={none}")


def test_one_sample_per_prompt_without_a_group_baseline():
    """PPO (its critic's GAE) and distillation alone (the teacher's term) take one sample per prompt; the
    critic-free group baselines, and DAPO's uniform-group filter, still need two."""
    from mtrain.config import ConfigError, load_config
    base = ["model.hf_path=x", "data.task=arithmetic", "rollout.samples_per_prompt=1"]
    load_config(None, base + ["algo.name=ppo"])
    load_config(None, base + ["algo.distill.teacher_path=t", "algo.distill.only=true"])
    for extra in ([], ["algo.distill.teacher_path=t"], ["algo.distill.teacher_path=t", "algo.distill.only=true",
                                                         "algo.name=dapo"]):
        with pytest.raises(ConfigError, match="rollout.samples_per_prompt: must be >= 2"):
            load_config(None, base + extra)
