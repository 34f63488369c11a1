"""`~` in a path: expanded once when the config is loaded (every key of config_sections.PATH_KEYS), and in the
command line's own path arguments. A shell leaves `key=~/x` (no expansion after `=` but in an assignment), a quoted
'~/x' and a YAML value as they are; before this, `train.run_dir=~/runs/x` made a folder literally named `~` in the
working directory."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from mtrain.config import RunConfig, _leaf_keys, load_config
from mtrain.config_sections import PATH_KEYS

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def _value(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, "async_mode" if part == "async" else part)
    return obj


def test_every_path_key_is_expanded(home):
    overrides = {"model.hf_path": "~/m", "model.mcore_ckpt": "~/ck", "data.train_path": "~/d/train.jsonl",
                 "data.eval_path": "~/d/eval.jsonl", "reward.fn": "~/r.py:score", "reward.judge.hf_path": "~/judge",
                 "train.run_dir": "~/runs/x", "train.resume": "~/runs/x/checkpoints/step_2",
                 "multi_turn.rollout_fn": "~/agent.py:rollout", "multi_turn.tools": "calculator,~/tools.py:Mine",
                 "multi_turn.retrieval_corpus": "~/corpus.txt"}
    (home / "judge").mkdir()
    (home / "judge" / "config.json").write_text("{}")  # the judge's folder is checked as the config loads
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in overrides.items()])
    for key, given in overrides.items():
        want = [str(home / v[2:]) if v.startswith("~") else v for v in given.split(",")]
        got = _value(cfg, key)
        assert (got if isinstance(got, list) else [got]) == want, key
    agent = load_config(CONFIG, ["serve.agent=~/agent.py:run"])  # not with multi_turn.rollout_fn
    assert agent.serve.agent == str(home / "agent.py") + ":run"
    # the keys PPO and distillation read (each needs its algorithm; checked here on their own)
    ppo = load_config(CONFIG, ["model.hf_path=~/m", "algo.name=ppo", "critic.hf_path=~/critic"])
    assert ppo.critic.hf_path == str(home / "critic")
    distill = load_config(CONFIG, ["model.hf_path=~/m", "algo.distill.teacher_path=~/teacher"])
    assert distill.algo.distill.teacher_path == str(home / "teacher")
    # in the config file as well as on the command line; the config file's own path too
    (home / "c.yaml").write_text(CONFIG.read_text().replace("runs/tiny_llama_grpo", "~/runs/from_file"))
    assert load_config("~/c.yaml").train.run_dir == str(home / "runs" / "from_file")
    # names that are not paths are left alone
    plain = load_config(CONFIG, ["train.resume=never"])
    assert plain.train.resume == "never" and plain.reward.fn == "mtrain.data.rewards:digit_share_reward"


def test_path_keys_name_every_path_valued_key():
    """A new key that holds a path must join PATH_KEYS (or it would keep a literal `~`)."""
    leaves = _leaf_keys(RunConfig)
    assert set(PATH_KEYS) <= set(leaves), set(PATH_KEYS) - set(leaves)
    pathlike = [k for k in leaves if k.rsplit(".", 1)[1].endswith(("path", "_dir", "_ckpt", "corpus", "_fn"))]
    assert set(pathlike) <= set(PATH_KEYS), set(pathlike) - set(PATH_KEYS)
    # every PATH_KEYS value is a string or a list of strings (what expanduser takes)
    hints = {}
    for key in PATH_KEYS:
        cls = RunConfig
        *sections, name = key.split(".")
        for part in sections:
            cls = typing.get_type_hints(cls)[part]
        hints[key] = typing.get_type_hints(cls)[name]
        assert dataclasses.is_dataclass(cls)
    assert all("str" in str(t) for t in hints.values()), hints


def test_run_dir_with_tilde_is_made_under_home_not_in_the_working_directory(home, tmp_path, monkeypatch):
    from mtrain.preflight import check_run_dir
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = load_config(CONFIG, ["train.run_dir=~/runs/x"])
    check_run_dir(cfg)  # the nearest existing folder is HOME, writable
    cfg.dump_yaml(Path(cfg.train.run_dir) / "config.yaml")
    assert (home / "runs" / "x" / "config.yaml").is_file()
    assert not (work / "~").exists()


def test_cli_path_arguments_expand_tilde(home, tmp_path, monkeypatch, capsys):
    from mtrain.__main__ import main
    monkeypatch.chdir(tmp_path)
    assert main(["init-tiny", "--arch", "llama", "--out", "~/tiny"]) == 0
    assert (home / "tiny" / "config.json").is_file() and not (tmp_path / "~").exists()
    # the converters' command line too
    from mtrain.converters.__main__ import build_parser
    args = build_parser().parse_args(["gguf-to-hf", "--gguf", "~/m.gguf", "--out", "~/hf"])
    assert (args.gguf, args.out) == (str(home / "m.gguf"), str(home / "hf"))
    assert build_parser().parse_args(["gguf-to-hf", "--gguf", "smollm2", "--out", "x"]).gguf == "smollm2"


def test_nearest_existing_is_the_one_rule_of_run_dir_and_init_tiny_out(tmp_path, capsys):
    """A file where a folder must be made: both checks name the same place, found by one function."""
    from mtrain.__main__ import main
    from mtrain.paths import nearest_existing
    from mtrain.preflight import check_run_dir
    from mtrain.config import ConfigError
    (tmp_path / "afile").write_text("")
    deep = tmp_path / "afile" / "a" / "b"
    assert nearest_existing(deep) == tmp_path / "afile"
    assert nearest_existing(tmp_path) == tmp_path
    assert nearest_existing("rel/not/there") == Path(".")
    cfg = load_config(CONFIG, [f"train.run_dir={deep}"])
    with pytest.raises(ConfigError, match=rf"^train\.run_dir: {tmp_path / 'afile'} is a file, not a folder"):
        check_run_dir(cfg)
    assert main(["init-tiny", "--arch", "llama", "--out", str(deep)]) == 2
    assert capsys.readouterr().err.strip() == f"mtrain init-tiny: error: --out {deep}: {tmp_path / 'afile'} is a file, " \
                                              f"not a folder"
