"""data.train_path / eval_path as HF dataset folders: save_to_disk (Dataset and DatasetDict) and hub parquet shards,
the split chosen by data.train_split / eval_split, chat-message columns, and one line for a missing column, also from
`mtrain train` before any process group starts."""
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtrain.config import load_config
from mtrain.data import DatasetError, load_datasets, load_prompts
from mtrain.tiny_hf import write_tiny_hf

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"

# verl-style rows: chat messages in `prompt`, the answer under reward_model.ground_truth
TRAIN = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "toy",
          "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(5)]
TEST = [{"prompt": [{"role": "user", "content": "What is 10 + 1?"}], "data_source": "toy",
         "reward_model": {"style": "rule", "ground_truth": "11"}}]
KEYS = dict(prompt_key="prompt", answer_key="reward_model.ground_truth")


def check(samples, rows):
    assert [s.prompt for s in samples] == [r["prompt"] for r in rows]
    assert [s.answer for s in samples] == [r["reward_model"]["ground_truth"] for r in rows]
    assert [s.metadata for s in samples] == [{"data_source": "toy"} for _ in rows]
    assert [s.index for s in samples] == list(range(len(rows)))


def test_save_to_disk_dataset_dict_and_dataset(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(tmp_path / "dd")
    check(load_prompts(tmp_path / "dd", **KEYS, split="train"), TRAIN)
    check(load_prompts(tmp_path / "dd", **KEYS, split="test"), TEST)
    with pytest.raises(DatasetError, match=r"no split 'validation' \(splits: \['test', 'train'\]\)"):
        load_prompts(tmp_path / "dd", **KEYS, split="validation")
    datasets.Dataset.from_list(TRAIN).save_to_disk(tmp_path / "one")  # a single Dataset: no split to choose
    check(load_prompts(tmp_path / "one", **KEYS, split="ignored"), TRAIN)


@pytest.mark.parametrize("layout", [("data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                                     "data/test-00000-of-00001.parquet"),
                                    ("main/train-00000-of-00002.parquet", "main/train-00001-of-00002.parquet",
                                     "main/test-00000-of-00001.parquet"),
                                    ("train/0000.parquet", "train/0001.parquet", "test/0000.parquet"),
                                    ("train-0.parquet", "train-1.parquet", "test.parquet")])
def test_hub_parquet_shards(tmp_path, layout):
    root = tmp_path / "hub"
    for name, rows in zip(layout, (TRAIN[:3], TRAIN[3:], TEST)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), root / name)
    check(load_prompts(root, **KEYS, split="train"), TRAIN)  # shards in name order: rows in their order
    check(load_prompts(root, **KEYS, split="test"), TEST)
    with pytest.raises(DatasetError, match=r"no parquet shards of split 'dev' \(splits found: \['test', 'train'\]\)"):
        load_prompts(root, **KEYS, split="dev")


def test_messages_column_with_the_assistant_turn_as_answer(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Box the answer."}, {"role": "user", "content": "1/2 + 1/4?"},
                          {"role": "assistant", "content": "It is \\boxed{\\frac{3}{4}}."}]}]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "sft")
    [s] = load_prompts(tmp_path / "sft", prompt_key="messages", answer_key="messages")
    assert s.prompt == rows[0]["messages"][:2]  # the model writes the assistant's turn
    assert s.answer == "It is \\boxed{\\frac{3}{4}}."
    pytest.importorskip("math_verify")
    from mtrain.data.rewards import math_verify_reward
    assert math_verify_reward("so \\boxed{0.75}", s.answer) == 1.0


def test_missing_column_is_one_line_naming_the_columns(tmp_path):
    datasets.Dataset.from_list(TRAIN).save_to_disk(tmp_path / "d")
    with pytest.raises(DatasetError) as e:
        load_prompts(tmp_path / "d", prompt_key="question", answer_key="reward_model.ground_truth")
    assert str(e.value) == (f"{tmp_path / 'd'}: missing column 'question' (for key 'question'); "
                            "columns: ['prompt', 'data_source', 'reward_model']")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="neither a `datasets` save_to_disk folder"):
        load_prompts(tmp_path / "empty")


def test_config_keys_choose_the_splits(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "validation": datasets.Dataset.from_list(TEST)}).save_to_disk(tmp_path / "dd")
    cfg = load_config(CONFIG, [f"data.train_path={tmp_path / 'dd'}", f"data.eval_path={tmp_path / 'dd'}",
                               "data.eval_split=validation", "data.answer_key=reward_model.ground_truth"])
    train, evals = load_datasets(cfg)
    check(train, TRAIN)
    check(evals, TEST)


def test_mtrain_train_refuses_a_missing_column_before_starting(tmp_path):
    hf = write_tiny_hf("llama", tmp_path / "llama")
    datasets.Dataset.from_list(TRAIN).save_to_disk(tmp_path / "d")
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), f"model.hf_path={hf}",
                        f"train.run_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'd'}", "data.task=null",
                        "data.answer_key=solution", "train.eval_interval=0", "train.val_before_train=false"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"mtrain: error: ConfigError: data.train_path: {tmp_path / 'd'}: missing column 'solution' (for key "
        "'solution'); columns: ['prompt', 'data_source', 'reward_model']"]
    assert not (tmp_path / "run").exists()
