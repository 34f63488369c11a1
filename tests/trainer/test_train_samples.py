"""RUN_DIR/train_samples.jsonl: a few training rollouts per step as text with their rewards, bounded (issue 46:
a new reward can be checked against what the model says without an eval file). Decoded from the batch the trainer
builds (`build_batch`), with the character tokenizer as the independent reference of what the text was."""
from __future__ import annotations

import json

from mtrain.data.tiny_tokenizer import CharTokenizer
from mtrain.rollout.protocol import Completion
from mtrain.trainer import train_samples
from mtrain.trainer.batch import build_batch
from mtrain.trainer.train_samples import write_train_samples


def _batch(tok, pairs, rewards):
    def ids(text):
        return tok.encode(text, add_special_tokens=False)
    comps = [Completion(rid=f"r{i}", prompt_ids=ids(p), output_ids=ids(r), logprobs=[-0.5] * len(ids(r)),
                        finish_reason="stop", weight_version=0) for i, (p, r) in enumerate(pairs)]
    return build_batch(comps, rewards, pad_id=tok.pad_token_id, pad_to_multiple=4)


def test_rows_are_the_prompt_response_and_reward_of_the_batch(tmp_path):
    tok = CharTokenizer(vocab_size=128)
    pairs = [("2+3=?", "5"), ("2+3=?", "6 is it"), ("2+3=?", "five"), ("2+3=?", "4"), ("1+1=?", "2")]
    batch = _batch(tok, pairs, [1.0, 0.0, 0.25, 0.0, 1.0])
    write_train_samples(tmp_path, 1, batch, tok, rank=0)
    write_train_samples(tmp_path, 1, batch, tok, rank=1)  # other ranks write nothing
    write_train_samples(tmp_path, 2, batch, tok, rank=0)
    rows = [json.loads(x) for x in (tmp_path / "train_samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["row"]) for r in rows] == [(s, i) for s in (1, 2) for i in range(4)]
    for r in rows:
        prompt, response = pairs[r["row"]]
        assert (r["prompt"], r["response"]) == (prompt, response)
        assert r["reward"] == [1.0, 0.0, 0.25, 0.0][r["row"]]


def test_the_file_is_bounded(tmp_path, monkeypatch):
    tok = CharTokenizer(vocab_size=128)
    batch = _batch(tok, [("q" * 50, "a" * 3000)] * 4, [0.0] * 4)
    monkeypatch.setattr(train_samples, "MAX_FILE_BYTES", 20_000)
    for step in range(1, 20):
        write_train_samples(tmp_path, step, batch, tok, rank=0)
    text = (tmp_path / "train_samples.jsonl").read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    assert len(text.encode()) < 20_000 and "no further samples" in rows[-1]["note"]
    assert all(len(r["response"]) < train_samples.MAX_CHARS + 40 for r in rows if "response" in r)


def test_a_resume_keeps_the_sample_rows_of_the_steps_it_keeps(tmp_path):
    # a run stopped after step 4 and resumed from step 2's checkpoint trains steps 3 and 4 again: their rows were
    # written twice (metrics.jsonl already keeps only steps <= 2); a fresh start replaced metrics only
    for name in ("train_samples.jsonl", "eval_samples.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps({"step": s, "row": 0}) + "\n" for s in (1, 2, 3, 4))
                                     + '{"step": 5, "ro')  # a line cut by the stop
    train_samples.keep_rows_through(tmp_path, 2)
    for name in ("train_samples.jsonl", "eval_samples.jsonl"):
        assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == [1, 2]
    train_samples.keep_rows_through(tmp_path, None)  # a fresh start in the same run_dir
    assert (tmp_path / "train_samples.jsonl").read_text() == "" == (tmp_path / "eval_samples.jsonl").read_text()
    train_samples.keep_rows_through(tmp_path / "nothing_here", 3)  # no files yet: nothing to do
