"""Prompt files: jsonl, json, parquet; dotted keys; chat-message prompts; one clear error per bad input."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtrain.config import load_config
from mtrain.data import DatasetError, PromptSample, load_datasets, load_prompts

RECORDS = [
    {"prompt": "What is 1 + 2?", "answer": "3", "source": "a"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
     "answer": 4, "source": "b"},
]


def write_jsonl(path, records, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(raw_lines))
    return path


def test_jsonl_json_and_parquet_give_the_same_samples(tmp_path):
    jl = load_prompts(write_jsonl(tmp_path / "p.jsonl", RECORDS))
    (tmp_path / "p.json").write_text(json.dumps(RECORDS))
    js = load_prompts(tmp_path / "p.json")
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 1 + 2?", "answer": "3", "source": "a"}]),
                   tmp_path / "p.parquet")
    pa_samples = load_prompts(tmp_path / "p.parquet")
    assert jl == js
    assert jl[0] == PromptSample(index=0, prompt="What is 1 + 2?", answer="3", metadata={"source": "a"})
    assert jl[1].prompt[1] == {"role": "user", "content": "2 + 2?"} and jl[1].answer == 4
    assert pa_samples == [jl[0]]


def test_dotted_keys_reach_nested_records(tmp_path):
    # verl-style rows: prompt messages plus reward_model.ground_truth
    rows = [{"question": {"text": "7 * 6?"}, "reward_model": {"ground_truth": "42", "style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    [s] = load_prompts(tmp_path / "v.parquet", prompt_key="question.text", answer_key="reward_model.ground_truth")
    assert s.prompt == "7 * 6?" and s.answer == "42"


def test_blank_lines_are_skipped_and_limit_applies(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS, raw_lines=["\n", json.dumps(RECORDS[0]) + "\n"])
    assert len(load_prompts(path)) == 3 and len(load_prompts(path, limit=2)) == 2


def test_missing_key_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [RECORDS[0], {"prompt": "x", "solution": "1"}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert f"{path}:2: missing key 'answer' (keys present: ['prompt', 'solution'])" in str(e.value)


def test_null_value_names_the_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
                   tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p\.parquet: row 1: null value for key 'answer'") as e:
        load_prompts(tmp_path / "p.parquet")
    # the field is the right one, its value is missing: was "; name the field with data.answer_key=answer"
    assert "data.answer_key" not in str(e.value) and "give every record one" in str(e.value)


def test_missing_parquet_column_is_one_error_listing_columns(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}]), tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"missing column 'prompt' .*columns: \['question', 'answer'\]"):
        load_prompts(tmp_path / "p.parquet")


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer}\n', r"p\.jsonl:2: invalid JSON"),
    ('["prompt", "answer"]\n', r"p\.jsonl:1: a record must be a JSON object"),
    ('{"prompt": "   ", "answer": "1"}\n', r"p\.jsonl:1: prompt 'prompt' is empty"),
    ('{"prompt": 5, "answer": "1"}\n', r"must be a non-empty string or a list of chat messages"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}\n', r"message 0 must be a dict with string 'role' and 'content'"),
    ("\n\n", r"p\.jsonl: no records"),
])
def test_bad_jsonl_content(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_prompts(tmp_path / "p.jsonl")


@pytest.mark.parametrize("name, content, message", [
    ("p.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n', r"p\.jsonl:2: not UTF-8 text"),
    ("p.json", b'[{"prompt": "\xe9", "answer": "1"}]', r"p\.json: not UTF-8 text"),
])
def test_bytes_that_are_not_utf8_name_the_file(tmp_path, name, content, message):
    # were a UnicodeDecodeError traceback
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=message):
        load_prompts(tmp_path / name)


@pytest.mark.parametrize("name, content", [("p.jsonl", '{"prompt": "a", "answer": "1"}\n'),
                                           ("p.json", '[{"prompt": "a", "answer": "1"}]')])
def test_a_utf8_byte_order_mark_is_read(tmp_path, name, content):
    # editors on Windows write one; json.loads refused it ("Unexpected UTF-8 BOM")
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + content.encode())
    assert [s.prompt for s in load_prompts(tmp_path / name)] == ["a"]


def test_bad_paths_and_types(tmp_path):
    with pytest.raises(DatasetError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"unknown prompt file type '\.csv'"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "p.json").write_text('{"prompt": "a"}')
    with pytest.raises(DatasetError, match="must hold a list of records"):
        load_prompts(tmp_path / "p.json")
    (tmp_path / "p.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_prompts(tmp_path / "p.parquet")


def test_load_datasets_from_config(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", RECORDS)
    cfg = load_config(None, ["model.hf_path=x", f"data.train_path={train}", f"data.eval_path={train}"])
    tr, ev = load_datasets(cfg)
    assert tr == ev and len(tr) == 2
    cfg = load_config(None, ["model.hf_path=x", "data.task=arithmetic", "data.arithmetic.num_train=10",
                             "data.arithmetic.num_eval=3"])
    tr, ev = load_datasets(cfg)
    assert len(tr) == 10 and len(ev) == 3
