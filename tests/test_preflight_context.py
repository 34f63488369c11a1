"""A prompt that cannot take rollout.max_new_tokens more within the model's context (max_position_embeddings): one
line before any work, naming the prompt's file and line and what to change. Before, the first step that drew it
stopped the run after the models were built, naming only "sample N". Configs whose limits exceed the context but
whose prompts all fit (the tiny models' 256 positions under the default max_prompt_len=256) still run."""
from __future__ import annotations

from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.data import load_prompts, tokenize_prompts
from mtrain.data.chat import PromptError
from mtrain.data.tiny_tokenizer import CharTokenizer
from mtrain.preflight import preflight
from mtrain.tiny_hf import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_hf("llama", tmp_path_factory.mktemp("ctx") / "llama")  # max_position_embeddings=256


def cfg_for(hf: Path, tmp_path: Path, *overrides: str):
    return load_config(CONFIG, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", *overrides])


def _prompts(tmp_path: Path, long_line: int, long_chars: int = 200) -> Path:
    lines = [f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}' for i in range(4)]
    lines[long_line - 1] = f'{{"prompt": "{"x" * long_chars}", "answer": "0"}}'
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_limits_beyond_the_context_with_prompts_that_fit_still_pass(hf, tmp_path):
    # 256 + 100 > 256 positions, but the arithmetic prompts (~60 tokens) + 100 fit: legitimate today, not refused
    cfg = cfg_for(hf, tmp_path, "rollout.max_prompt_len=256", "rollout.max_new_tokens=100")
    assert preflight(cfg, world=1)["max_position_embeddings"] == 256


def test_a_prompt_beyond_the_context_is_named_by_file_and_line_before_any_work(hf, tmp_path):
    data = _prompts(tmp_path, long_line=3)
    cfg = cfg_for(hf, tmp_path, f"data.train_path={data}", "rollout.max_prompt_len=400", "rollout.max_new_tokens=100")
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world=1)
    msg = str(e.value)
    assert msg.startswith(f"rollout.max_new_tokens: {data}:3: prompt of ") and "\n" not in msg, msg
    n = int(msg.split("prompt of ")[1].split()[0])
    assert n + 100 > 256
    assert f"(max_position_embeddings=256): lower rollout.max_new_tokens to {256 - n} or less" in msg
    assert "rollout.max_prompt_len=156 and data.drop_overlong_prompts=true" in msg
    assert not (tmp_path / "run").exists()
    # what it says to change runs: the lower max_new_tokens, or dropping the long prompt
    assert preflight(cfg_for(hf, tmp_path, f"data.train_path={data}", "rollout.max_prompt_len=400",
                             f"rollout.max_new_tokens={256 - n}"), world=1)
    assert preflight(cfg_for(hf, tmp_path, f"data.train_path={data}", "rollout.max_prompt_len=156",
                             "rollout.max_new_tokens=100", "data.drop_overlong_prompts=true"), world=1)


def test_the_eval_file_is_checked_too(hf, tmp_path):
    good = _prompts(tmp_path, long_line=1, long_chars=5)
    (tmp_path / "e").mkdir()
    bad = _prompts(tmp_path / "e", long_line=2)
    cfg = cfg_for(hf, tmp_path, f"data.train_path={good}", f"data.eval_path={bad}", "rollout.max_prompt_len=400",
                  "rollout.max_new_tokens=100")
    with pytest.raises(ConfigError, match=rf"^rollout\.max_new_tokens: {bad}:2: prompt of "):
        preflight(cfg, world=1)


def test_a_prompt_longer_than_max_prompt_len_names_its_file_and_line(tmp_path):
    data = _prompts(tmp_path, long_line=4)
    samples = load_prompts(data)
    with pytest.raises(PromptError, match=rf"^{data}:4: prompt has \d+ tokens > rollout\.max_prompt_len=50; "):
        tokenize_prompts(samples, CharTokenizer(), max_prompt_len=50, apply_chat_template=False)
    # a generated task's samples have no file: their index names them
    from mtrain.data.records import PromptSample
    with pytest.raises(PromptError, match=r"^sample 7: prompt has"):
        tokenize_prompts([PromptSample(7, "x" * 80, "0")], CharTokenizer(), max_prompt_len=50,
                         apply_chat_template=False)


def test_preflight_loads_the_tokenizer_once(hf, tmp_path, monkeypatch):
    """The chat-template check and the prompt-context check both need the tokenizer: one load from disk (each was its
    own `from_pretrained`, seconds for a real tokenizer)."""
    from test_preflight import _with_tokenizer
    from transformers import AutoTokenizer
    chat = _with_tokenizer(hf, tmp_path / "chat", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    loads, real = [], AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: loads.append(a) or real(cls, *a, **kw)))
    cfg = cfg_for(chat, tmp_path, "rollout.max_prompt_len=256", "rollout.max_new_tokens=100")  # renders every prompt
    preflight(cfg, world=1)
    assert loads == [(str(chat),)]


def _bpe_files_only(src: Path, out: Path) -> Path:
    """A copy of a tiny model whose tokenizer is a GPT-2 style vocab.json + merges.txt and nothing else."""
    import json
    import shutil
    from mtrain.tokenizer_files import CHAR_TOKENIZER_MARKER
    shutil.copytree(src, out)
    (out / CHAR_TOKENIZER_MARKER).unlink()
    (out / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (out / "merges.txt").write_text("#version: 0.2\na b\n")
    return out


def test_vocab_and_merges_alone_are_the_models_tokenizer_or_one_line(hf, tmp_path):
    """check_tokenizer accepts vocab.json + merges.txt as a tokenizer; the trainer read the same folder through the
    character tokenizer (a real model trained on garbage, no error). Files that do not load are one line."""
    import json
    from mtrain.trainer.engines import load_tokenizer
    qwen2 = _bpe_files_only(write_tiny_hf("qwen2", tmp_path / "q"), tmp_path / "qwen2")
    tok = load_tokenizer(qwen2, json.loads((qwen2 / "config.json").read_text()))
    assert not isinstance(tok, CharTokenizer) and tok.convert_tokens_to_ids("ab") == 2
    llama = _bpe_files_only(hf, tmp_path / "llama")  # a Llama tokenizer is not a vocab.json + merges.txt one
    with pytest.raises(ConfigError) as e:
        preflight(cfg_for(llama, tmp_path), world=1)
    assert str(e.value).startswith(f"model.hf_path: the tokenizer files in {llama} (vocab.json, merges.txt) do not "
                                   f"load (") and "\n" not in str(e.value)
