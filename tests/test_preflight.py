"""Checks before any process group starts (issue 19, points 1, 6, 7): one line naming the key, exit 2, in seconds.

In-process calls of `preflight(cfg, world)` cover the rules; one `mtrain train` subprocess shows the user's view
(one line, exit 2, nothing written). The damaged dist checkpoint comes from a real conversion made once.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtrain.config import ConfigError, load_config
from mtrain.preflight import preflight
from mtrain.tiny_hf import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_hf("llama", tmp_path_factory.mktemp("pf") / "llama")  # 4 heads, 2 KV heads, 4 layers


def cfg_for(hf: Path, tmp_path: Path, *overrides: str):
    return load_config(CONFIG, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", *overrides])


def fails(cfg, match: str, world: int = 1) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        preflight(cfg, world=world)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_good_config_passes(hf, tmp_path):
    assert preflight(cfg_for(hf, tmp_path), world=1)["model_type"] == "llama"
    assert preflight(cfg_for(hf, tmp_path, "parallel.tp=2"), world=2)["model_type"] == "llama"
    # an uneven pipeline split (4 layers as 2 | 1 | 1) is the trainer's layout, not an error
    assert preflight(cfg_for(hf, tmp_path, "parallel.pp=3", "parallel.first_stage_layers=2",
                             "rollout.prompts_per_step=3"), world=3)


def test_missing_hf_path_is_one_line_exit_2_in_seconds(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), f"model.hf_path={tmp_path / 'nope'}",
                        f"train.run_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"mtrain: error: ConfigError: model.hf_path: {tmp_path / 'nope'} is not a HF model dir (no config.json)"]
    assert not (tmp_path / "run").exists()
    assert elapsed < 30  # no Megatron import, no process group (was a FileNotFoundError after ~8 s of set-up)


@pytest.mark.parametrize("world, over, match", [
    # 3 prompts x 4 samples = 12 over dp=2 ranks of micro batches of 4: fails only after the first rollout today
    (2, ["rollout.prompts_per_step=3"], r"train\.micro_batch_size: rollout\.prompts_per_step x "
                                        r"rollout\.samples_per_prompt = 3 x 4 = 12 samples .* 2 data-parallel "
                                        r"rank\(s\) .* multiple of 8"),
    (4, ["train.global_batch_size=8", "train.micro_batch_size=4"], r"train\.global_batch_size = 8 .* 4 "
                                                                     r"data-parallel .* multiple of 16"),
    (3, ["parallel.tp=2"], r"parallel: world_size=3 is not divisible by tp\*pp\*cp"),
    (3, ["parallel.tp=3"], r"parallel: tp=3 pp=1 .* do not fit the model: .*query groups"),
    (3, ["parallel.pp=3", "rollout.prompts_per_step=3"], r"parallel: .* num layers \(4\) is not divisible by pp"),
    (1, ["rollout.max_new_tokens=4096"], r"rollout\.max_new_tokens: 4096 leaves no room"),
    (1, ["engine.kind=sglang", "engine.tp=3", "sync.mode=push"], r"engine\.tp: engine tp=3 ep=1 does not fit the "
                                                                  r"model: .*not divisible"),
    (1, ["train.log_tensorboard=true"], r"train\.log_tensorboard: true, but TensorBoard is not installed"),
])
def test_settings_that_cannot_run(hf, tmp_path, world, over, match):
    if "tensorboard" in match and importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    fails(cfg_for(hf, tmp_path, *over), match, world=world)


def edited_copy(hf: Path, tmp_path: Path, fn) -> Path:
    out = Path(shutil.copytree(hf, tmp_path / "edited"))
    state = load_file(out / "model.safetensors")
    fn(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_unexpected_tensor_is_refused_as_by_the_converter(hf, tmp_path):
    from mtrain.converters.errors import CheckpointError
    from mtrain.converters.hf_to_mcore import check_input
    bad = edited_copy(hf, tmp_path, lambda s: s.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    msg = fails(cfg_for(bad, tmp_path), r"model\.hf_path: .*unexpected tensor.*model\.layers\.0\.mlp\.extra_proj")
    with pytest.raises(CheckpointError) as e:  # the converter's words, the same rule
        check_input(bad, 1, 1, 1, None)
    assert msg == f"model.hf_path: {e.value}"


def test_missing_and_misshapen_tensors(hf, tmp_path):
    bad = edited_copy(hf, tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    fails(cfg_for(bad, tmp_path), r"missing tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight")
    shutil.rmtree(bad)
    bad = edited_copy(hf, tmp_path, lambda s: s.update({"model.norm.weight": torch.zeros(3)}))
    fails(cfg_for(bad, tmp_path), r"tensor 'model\.norm\.weight' has shape \[3\]")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_config_json_without_a_required_field(hf, tmp_path, field):
    # was a KeyError traceback from the layout tables
    import json
    bad = tmp_path / "nofield"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg[field]
    (bad / "config.json").write_text(json.dumps(cfg))
    fails(cfg_for(bad, tmp_path), rf"^model\.hf_path: .*missing required field '{field}'")


@pytest.mark.parametrize("run_dir", ["afile", "afile/sub"])
def test_a_run_dir_at_or_below_a_file(hf, tmp_path, run_dir):
    # was a FileExistsError / NotADirectoryError traceback once the models were built
    (tmp_path / "afile").write_text("")
    cfg = cfg_for(hf, tmp_path, f"train.run_dir={tmp_path / run_dir}")
    fails(cfg, rf"^train\.run_dir: {tmp_path / 'afile'} is a file, not a folder")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_run_dir_where_no_folder_can_be_made(hf, tmp_path):
    # /proc takes no new folder, yet os.access says writable to root (as for a read-only mount): that was a
    # FileNotFoundError / OSError traceback per rank once the models were built
    fails(cfg_for(hf, tmp_path, "train.run_dir=/proc/mtrain_run"),
          r"^train\.run_dir: cannot make a folder in /proc \(.*\): pick another train\.run_dir$")
    assert not list(tmp_path.glob(".mtrain_write_probe_*"))
    preflight(cfg_for(hf, tmp_path), world=1)
    assert not list(tmp_path.glob(".mtrain_write_probe_*"))  # the probe is removed


def test_bitwise_tensor_parallel_needs_power_of_two_row_parallel_slices(hf, tmp_path):
    # the tiny Llama's MLP (intermediate_size 96) gives 48 per rank at TP2: the bitwise row-parallel layer refused
    # it with a ValueError traceback while the model was built, after the process groups had started
    over = ("parallel.tp=2", "numerics.on_policy=bitwise", "engine.kind=reference")
    fails(cfg_for(hf, tmp_path, *over), r"^numerics\.on_policy: bitwise at parallel\.tp=2: .*96/2=48 is not one "
          r"\(this model's intermediate_size=96\)",
          world=2)
    pow2 = write_tiny_hf("llama", tmp_path / "pow2", overrides={"intermediate_size": 128})
    assert preflight(cfg_for(pow2, tmp_path, *over), world=2)["model_type"] == "llama"


@pytest.mark.parametrize("arch,changes,match", [
    ("deepseek_v3", {}, "deepseek_v3 with these settings is not built for it"),  # MLA, sigmoid router, yarn
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}, "llama with these settings"),
    ("qwen3_yarn", {}, "qwen3 with these settings"),
    ("mistral", {}, "the reference engine computes llama, qwen2, qwen3, qwen3_moe with plain RoPE; got mistral"),
])
def test_bitwise_refuses_a_model_it_does_not_compute_before_any_process_group(tmp_path, arch, changes, match):
    """Was a ValueError traceback on every rank once the process groups had started (exit 1)."""
    hf = write_tiny_hf(arch, tmp_path / arch, overrides=changes)
    fails(cfg_for(hf, tmp_path, "numerics.on_policy=bitwise", "engine.kind=reference"),
          f"numerics.on_policy: .*{match}")


def test_bitwise_runs_qwen2_and_its_biases(tmp_path):
    preflight(cfg_for(write_tiny_hf("qwen2", tmp_path / "qwen2"), tmp_path, "numerics.on_policy=bitwise",
                      "engine.kind=reference"), world=1)


@pytest.mark.parametrize("changes,match", [
    ({"mlp_only_layers": [0], "moe_intermediate_size": 32}, r"96/2=48 .*this model's intermediate_size=96"),  # dense
    ({"intermediate_size": 128, "moe_intermediate_size": 48}, r"48/2=24 .*this model's moe_intermediate_size=48"),
])
def test_bitwise_tensor_parallel_checks_a_moe_models_dense_layers_and_experts(tmp_path, changes, match):
    """A Qwen3-MoE with a dense layer (mlp_only_layers) was left to the build: a ValueError traceback per rank."""
    hf = write_tiny_hf("qwen3_moe", tmp_path / "moe", overrides=changes)
    over = ("parallel.tp=2", "numerics.on_policy=bitwise", "engine.kind=reference")
    fails(cfg_for(hf, tmp_path, *over), rf"^numerics\.on_policy: bitwise at parallel\.tp=2: .*{match}", world=2)


def _with_tokenizer(hf: Path, out: Path, chat_template: str | None) -> Path:
    """A copy of the tiny model with a real (word-level) HF tokenizer instead of the character tokenizer's marker."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtrain.tokenizer_files import CHAR_TOKENIZER_MARKER
    shutil.copytree(hf, out)
    (out / CHAR_TOKENIZER_MARKER).unlink()
    words = ["<pad>", "<s>", "</s>", "<unk>", "What", "is", "+", "?"] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return out


def test_a_tokenizer_without_a_chat_template_is_refused_before_any_process_group(hf, tmp_path):
    """data.apply_chat_template=true (the default) with a tokenizer that has no template: the run built its models
    and stopped at the first step with a PromptError per rank."""
    bare = _with_tokenizer(hf, tmp_path / "bare", None)
    fails(cfg_for(bare, tmp_path), r"^data\.apply_chat_template: .* the tokenizer in .* has none; set "
                                   r"data\.apply_chat_template=false")
    preflight(cfg_for(bare, tmp_path, "data.apply_chat_template=false"), world=1)
    # tool rollouts and agents render every turn through the template: a transformers traceback per rank at step 1
    tools = ("data.apply_chat_template=false", "multi_turn.rollout_fn=mtrain.rollout.agents.multi_turn:rollout_group",
             "multi_turn.tools=calculator")
    fails(cfg_for(bare, tmp_path, *tools), r"^multi_turn\.rollout_fn: renders prompts .* has none; add")
    agent = f"serve.agent={REPO / 'tests' / 'trainer' / 'agents_for_tests.py'}:two_turn_digits"
    fails(cfg_for(bare, tmp_path, "data.apply_chat_template=false", agent), r"^serve\.agent: renders prompts")
    chat = _with_tokenizer(hf, tmp_path / "chat", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    preflight(cfg_for(chat, tmp_path), world=1)


def test_a_bad_eval_file_names_data_eval_path(hf, tmp_path):
    # the line named data.train_path for a problem in the eval file
    good, bad = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    good.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    bad.write_text('{"prompt": "2 + 2?", answer}\n')
    fails(cfg_for(hf, tmp_path, f"data.train_path={good}", f"data.eval_path={bad}"),
          rf"^data\.eval_path: {bad}:1: invalid JSON")
    fails(cfg_for(hf, tmp_path, f"data.train_path={bad}", f"data.eval_path={good}"),
          rf"^data\.train_path: {bad}:1: invalid JSON")


@pytest.fixture(scope="module")
def mcore(hf, tmp_path_factory) -> Path:
    from mtrain.converters.hf_to_mcore import hf_to_mcore
    return hf_to_mcore(hf, tmp_path_factory.mktemp("pf_mcore") / "mcore")


@pytest.mark.parametrize("damage, match", [
    ("shard", r"model\.mcore_ckpt: .*shard file __0_0\.distcp is missing"),
    ("truncate", r"model\.mcore_ckpt: .*__0_0\.distcp: truncated shard"),
    (".metadata", r"model\.mcore_ckpt: .*incomplete Megatron dist checkpoint .*missing \.metadata"),
])
def test_damaged_mcore_ckpt(hf, mcore, tmp_path, damage, match):
    assert preflight(cfg_for(hf, tmp_path, f"model.mcore_ckpt={mcore}"), world=1)
    ckpt = Path(shutil.copytree(mcore, tmp_path / "mcore"))
    if damage == "shard":
        (ckpt / "__0_0.distcp").unlink()
    elif damage == "truncate":
        f = ckpt / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:100])
    else:
        (ckpt / damage).unlink()
    fails(cfg_for(hf, tmp_path, f"model.mcore_ckpt={ckpt}"), match)


def test_explicit_resume_path_must_be_an_intact_checkpoint(hf, tmp_path):
    (tmp_path / "step_3").mkdir()
    fails(cfg_for(hf, tmp_path, f"train.resume={tmp_path / 'step_3'}"), r"train\.resume: .*step_3 has no COMPLETE")
    fails(cfg_for(hf, tmp_path, f"train.resume={tmp_path / 'nowhere'}"), r"train\.resume: .* is not a checkpoint")


def test_moe_with_tensor_parallel_is_refused_without_sequence_parallel(tmp_path):
    """issue 18: CP x TP for a MoE model (and MoE x TP at all) cannot train on megatron-core 0.16.1's local spec
    (MoE + TP needs sequence parallelism, which needs Transformer Engine): one line before any process starts;
    CP x EP is the layout that works."""
    from mtrain.compat.no_te import te_installed
    moe = write_tiny_hf("qwen3_moe", tmp_path / "moe")
    cfg = cfg_for(moe, tmp_path, "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=false")
    msg = fails(cfg, r"parallel\.tp: 2 with a MoE model \(4 experts\) trains only with sequence parallelism", world=4)
    assert "parallel.ep" in msg
    if not te_installed():
        fails(cfg_for(moe, tmp_path, "parallel.tp=2"), r"Transformer Engine is not importable here", world=2)
    assert preflight(cfg_for(moe, tmp_path, "parallel.ep=2", "parallel.cp=2"), world=2)["model_type"] == "qwen3_moe"
    # numerics.on_policy=bitwise: its MoE layer computes every token on every TP rank (no dispatcher, no SP needed)
    bitwise = cfg_for(moe, tmp_path, "parallel.tp=2", "numerics.on_policy=bitwise", "engine.kind=reference")
    assert preflight(bitwise, world=2)["model_type"] == "qwen3_moe"
    # dense models are not affected
    dense = write_tiny_hf("qwen3", tmp_path / "dense")
    assert preflight(cfg_for(dense, tmp_path, "parallel.tp=2", "parallel.cp=2"), world=4)
