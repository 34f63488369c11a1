"""The run config: YAML + overrides, type coercion, unknown keys with suggestions, presets, validation."""
from pathlib import Path

import pytest
import yaml

from mtrain.config import ALGO_PRESETS, ConfigError, RunConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
BASE = ["model.hf_path=/models/tiny", "data.task=arithmetic"]  # the two settings without a default


def write_yaml(tmp_path, tree) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def test_example_config_loads_and_prints_every_section():
    cfg = load_config(EXAMPLE)
    assert cfg.model.hf_path == "runs/tiny_llama/hf" and cfg.data.task == "arithmetic"
    text = cfg.format_config()
    for section in ("model", "parallel", "engine", "rollout", "algo", "optim", "data", "reward", "train", "sync"):
        assert f"\n{section}:" in "\n" + text
    assert yaml.safe_load(text) == cfg.to_dict()


def test_dump_and_reload_round_trip(tmp_path):
    cfg = load_config(EXAMPLE, ["data.arithmetic.ops=+-*", "rollout.stop_token_ids=[5, 7]",
                                "data.system_prompt=no", "algo.name=dapo"])
    out = cfg.dump_yaml(tmp_path / "sub" / "config.yaml")
    assert load_config(out) == cfg
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.yaml"]  # no temp file left behind


def test_overrides_are_coerced_to_field_types():
    cfg = load_config(None, BASE + [
        "optim.lr=1e-6",  # PyYAML reads this as a string: must become a float
        "rollout.max_new_tokens=32", "rollout.temperature=1", "engine.colocate=false",
        "rollout.stop_token_ids=3,4", "engine.attention_backend=fa3", "parallel.vpp=null",
        "model.hf_path=007",  # strings stay verbatim (YAML would make this the int 7)
        "data.system_prompt=no",  # ... and this False
        "--train.steps=7",
    ])
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.max_new_tokens == 32 and cfg.rollout.temperature == 1.0
    assert cfg.engine.colocate is False and cfg.rollout.stop_token_ids == [3, 4]
    assert cfg.engine.attention_backend == "fa3" and cfg.parallel.vpp is None
    assert cfg.model.hf_path == "007" and cfg.data.system_prompt == "no" and cfg.train.steps == 7
    # a YAML list (as in the file) is a list too, not split at its commas into '[qkv' and 'o_proj]' (a ParserError)
    assert load_config(None, BASE + ["model.lora.targets=[qkv, o_proj]"]).model.lora.targets == ["qkv", "o_proj"]
    assert load_config(None, BASE + ["model.lora.targets=qkv,o_proj"]).model.lora.targets == ["qkv", "o_proj"]


@pytest.mark.parametrize("override, message", [
    ("rollout.max_new_tokens=abc", "rollout.max_new_tokens: expected int, got 'abc'"),
    ("engine.colocate=maybe", "engine.colocate: expected bool"),
    ("rollout.stop_token_ids=[1, x]", "rollout.stop_token_ids[1]: expected int"),
    ("algo.name=a2c", "algo.name: 'a2c' is not one of 'grpo', 'dr_grpo', 'dapo', 'gspo', 'reinforce_pp', 'ppo'"),
    ("algo.kl_estimator=k4", "algo.kl_estimator: 'k4' is not one of 'k1', 'k2', 'k3'"),
    ("algo=grpo", "'algo' is a section"),
    ("train.steps", "must look like section.key=value"),
    ("engine.fp8_scaling=tensor", "engine.fp8_scaling: must be auto, block or channel, got 'tensor'"),
    ("engine.fp8_scaling=channel", "engine.fp8_scaling: channel is an FP8 engine's format: it needs "
                                   "engine.weight_dtype=fp8"),
    # values YAML cannot read were a ParserError / ScannerError traceback
    ("optim.lr=[1", "optim.lr: expected float, got '[1' (str)"),
    ("optim.lr=@x", "optim.lr: expected float, got '@x' (str)"),
    ("engine.server_args={a: 1", "engine.server_args: expected a mapping of names to values, got '{a: 1'"),
    ("rollout.stop_token_ids=[1, 2", "rollout.stop_token_ids[0]: expected int, got '[1' (str)"),
])
def test_bad_override_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, BASE + [override])
    assert message in str(e.value)


@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.lr=.inf", "train.collective_timeout_s=inf",
                                      "optim.clip_grad=inf", "multi_turn.tool_reward_weight=nan", "reward.timeout_s=inf",
                                      "reward.judge.weight=nan"])
def test_non_finite_floats_are_refused_at_the_key(override):
    # inf passed every `> 0` check (lr=inf trained to NaN weights, collective_timeout_s=inf died in timedelta);
    # NaN passed keys with no range check at all
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number, got "):
        load_config(None, BASE + [override])


@pytest.mark.parametrize("override, suggestion", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("optim.lrr=1", "did you mean 'optim.lr'?"),
    ("optm.lr=1", "did you mean 'optim.lr'?"),
    ("algo.clip_eps_hgh=0.3", "did you mean 'algo.clip_eps_high'?"),
    ("data.arithmetic.max_operands=9", "did you mean 'data.arithmetic.max_operand'?"),
    ("train.steps.x=1", "unknown config key 'train.steps.x'"),
    # a key of another section: was "did you mean 'train'?" (a section name) and "'optim.clip_grad'"
    ("train.lr=1e-5", "did you mean 'optim.lr'?"),
    ("train.temperature=0.7", "did you mean 'rollout.temperature'?"),
    ("algo.steps=3", "did you mean 'train.steps'?"),
])
def test_unknown_override_key_suggests_the_closest(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [override])
    assert suggestion in str(e.value)


def test_unknown_yaml_key_names_file_and_full_key(tmp_path):
    path = write_yaml(tmp_path, {"model": {"hf_path": "x"}, "rollout": {"samples_per_promt": 4}})
    with pytest.raises(ConfigError) as e:
        load_config(path, ["data.task=arithmetic"])
    msg = str(e.value)
    assert "'rollout.samples_per_promt'" in msg and str(path) in msg
    assert "did you mean 'rollout.samples_per_prompt'?" in msg


def test_yaml_type_errors_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr: expected float, got \[1\]"):
        load_config(write_yaml(tmp_path, {"optim": {"lr": [1]}}), BASE)
    with pytest.raises(ConfigError, match="'rollout' .* must be a mapping"):
        load_config(write_yaml(tmp_path, {"rollout": 5}), BASE)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="is not valid YAML") as e:
        load_config(bad)
    assert "\n" not in str(e.value) and "line 1, column 17" in str(e.value)  # one line: the error line is atomic


def test_algorithm_presets_fill_only_unset_knobs():
    dapo = load_config(None, BASE + ["algo.name=dapo"])
    assert dapo.algo.clip_eps_high == 0.28 and dapo.algo.loss_agg == "token_mean"
    assert dapo.algo.kl_coef == 0.0 and dapo.algo.filter_uniform_groups is True
    mine = load_config(None, BASE + ["algo.name=dapo", "algo.clip_eps_high=0.3"])
    assert mine.algo.clip_eps_high == 0.3 and mine.algo.clip_eps_low == 0.2
    for name, preset in ALGO_PRESETS.items():
        cfg = load_config(None, BASE + [f"algo.name={name}"])
        assert {k: getattr(cfg.algo, k) for k in preset} == preset


@pytest.mark.parametrize("overrides, message", [
    (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt: must be >= 2 for grpo"),
    (["algo.clip_eps_low=0"], "algo.clip_eps_low: must be in (0, 1)"),
    (["algo.clip_eps_high=-0.1"], "algo.clip_eps_high: must be > 0"),
    (["algo.dual_clip_c=0.5"], "algo.dual_clip_c: must be > 1"),
    (["data.train_path=x.jsonl"], "set exactly one of data.train_path and data.task"),
    (["parallel.vpp=2"], "parallel.vpp: needs parallel.pp > 1"),
    (["parallel.tp=0"], "parallel.tp: must be >= 1"),
    (["engine.mem_fraction_static=1.5"], "engine.mem_fraction_static: must be in (0, 1)"),
    (["train.global_batch_size=12"], "train.global_batch_size: must divide the rollout batch"),
    (["train.micro_batch_size=3"], "train.micro_batch_size: must divide the global batch size 32"),
    (["rollout.temperature=0"], "rollout.temperature: must be > 0"),
    (["optim.min_lr=1"], "optim.min_lr: must be in [0, optim.lr=1e-06]"),
    (["train.eval_interval=5", "data.arithmetic.num_eval=0"], "there is no eval set"),
    (["reward.fn=nocolon"], "reward.fn: must look like 'module:function'"),
    (["data.arithmetic.ops=+/"], "data.arithmetic.ops: must be a non-empty string"),
    (["engine.nnodes=0"], "engine.nnodes: must be >= 1"),
    (["rollout.max_groups_in_flight=0"], "rollout.max_groups_in_flight: must be >= 1"),
    (["train.save_interval=-2"], "train.save_interval: must be >= -1"),
])
def test_cross_field_validation(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + overrides)
    assert message in str(e.value)


def test_hf_path_is_required():
    with pytest.raises(ConfigError, match="model.hf_path: is required"):
        load_config(None, ["data.task=arithmetic"])


def test_defaults_and_rollout_batch_size():
    cfg = load_config(None, BASE + ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=5",
                                    "train.micro_batch_size=5"])
    assert isinstance(cfg, RunConfig) and cfg.rollout_batch_size == 15
    assert cfg.algo.name == "grpo" and cfg.reward.fn == "mtrain.data.rewards:exact_match_reward"


def test_check_files_finds_missing_model_and_data(tmp_path):
    with pytest.raises(ConfigError, match=r"model.hf_path: /models/tiny is not a HF model dir \(no config.json\)"):
        load_config(None, BASE, check_files=True)
    (tmp_path / "config.json").write_text("{}")
    ok = [f"model.hf_path={tmp_path}", "data.task=arithmetic"]
    assert load_config(None, ok, check_files=True).model.hf_path == str(tmp_path)
    with pytest.raises(ConfigError, match="model.mcore_ckpt: .*nope does not exist"):
        load_config(None, ok + [f"model.mcore_ckpt={tmp_path / 'nope'}"], check_files=True)
    with pytest.raises(ConfigError, match="data.train_path: .*train.jsonl is not a file"):
        load_config(None, [f"model.hf_path={tmp_path}", f"data.train_path={tmp_path / 'train.jsonl'}"],
                    check_files=True)


def test_run_decisions():
    """The machine-dependent decisions, made once (mtrain.trainer.decisions) for given cuda/te answers."""
    from mtrain.trainer.decisions import decide
    from mtrain.trainer.publishers.colocated import sync_mode

    def cfg(*o):
        return load_config(None, ["model.hf_path=x", "data.task=arithmetic", *o])

    d = decide(cfg(), world_size=4, local_world_size=4, cuda=False, te=False)
    assert (d.device, d.engine_kind, d.engine_layout, d.sync_mode) == ("cpu", "reference", "hf", "pull")
    assert d.groups.count == 4 and d.colocate and not d.offload_train and not d.sequence_parallel
    d = decide(cfg("engine.tp=2", "parallel.tp=2", "engine.offload_train=true"), world_size=8, local_world_size=8,
               cuda=True, te=True)
    assert (d.engine_kind, d.engine_layout, d.groups.count, d.sequence_parallel, d.offload_train) == \
        ("sglang", "sglang", 4, True, True)
    assert decide(cfg("sync.mode=push"), world_size=2, local_world_size=2, cuda=True, te=False).sync_mode == "push"
    with pytest.raises(ConfigError, match="engine.tp / engine.nnodes: engine.tp=3 does not divide the 4 ranks"):
        decide(cfg("engine.tp=3"), world_size=4, local_world_size=4, cuda=False, te=False)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: true needs Transformer Engine"):
        decide(cfg("parallel.sequence_parallel=true", "parallel.tp=2"), world_size=2, local_world_size=2, cuda=True,
               te=False)
    with pytest.raises(ConfigError, match="engine.kind: sglang needs a GPU"):
        decide(cfg("engine.kind=sglang"), world_size=1, local_world_size=1, cuda=False, te=False)
    with pytest.raises(ConfigError, match="must be auto, pull or push"):
        sync_mode("both")
