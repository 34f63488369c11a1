"""ChoiceStream (mtrain/serve/streaming.py) against the whole-text decode as reference: what it streams is always a
prefix of the finished text, never half a character, never the start of a stop string or of tool-call markup, and
with finish() adds up to exactly the finished text. Real HF fast tokenizers: byte-level BPE (a character over several
tokens), a Metaspace one (SentencePiece-style leading-space handling) and the front's test tokenizer."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from front_fixtures import chatml_tokenizer
from mtrain.serve.streaming import ChoiceStream

TEXT = "héllo wörld ✓ 56 ok 😀 ünïcödé <tool_call>\n{} done"


def byte_level() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def metaspace() -> PreTrainedTokenizerFast:
    chars = sorted(set(TEXT.replace(" ", "")) | {"▁"})
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["▁h"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h")]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # drops the first token's leading space only: window decodes differ
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TOKENIZERS = {"byte_level": byte_level, "metaspace": metaspace, "chatml": chatml_tokenizer}


def run(tok, ids, stops=(), marker=None, seed=0, valid=True):
    """Push ids in random-size pieces; returns (streamed text, tokens taken, the stream)."""
    rng = random.Random(seed)
    s = ChoiceStream(tok, list(stops), (tok.eos_token_id,), marker)
    out, taken, i = "", 0, 0
    while i < len(ids):
        k = rng.randint(1, 3)
        piece, n = s.push(ids[i:i + k])
        assert not valid or "\ufffd" not in piece  # valid UTF-8 never streams half a character
        out += piece
        taken += n
        i += k
    return out, taken, s


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_streamed_text_is_the_whole_decode(name):
    tok = TOKENIZERS[name]()
    text = TEXT if name != "chatml" else "hello 56 world <tool_call>\n{} done"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    full = tok.decode(ids[:-1], skip_special_tokens=True)
    for seed in range(3):
        out, taken, s = run(tok, ids, seed=seed)
        assert full.startswith(out) and taken == len(ids)
        assert len(full) - len(out) <= 1 and out + s.finish(full) == full  # all final at the end of the tokens


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_stop_strings_are_held_back_and_cut_at_the_first_token_completing_one(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode(TEXT, add_special_tokens=False)
    for stops in (["wörld"], ["ö"], ["😀", "✓ 5"], ["ok 😀 ü"], ["never there"]):
        out, taken, s = run(tok, ids, stops)
        full = tok.decode(ids, skip_special_tokens=True)
        hits = [full.find(x) for x in stops if x in full]
        want = full[:min(hits)] if hits else full
        # reference: the first prefix of the tokens whose decode contains a stop string
        k = next((k for k in range(1, len(ids) + 1)
                  if any(x in tok.decode(ids[:k], skip_special_tokens=True) for x in stops)), len(ids))
        assert taken == k and want.startswith(out) and out + s.finish(want) == want
        assert not any(x in out for x in stops)


def test_tool_markup_never_streams_as_content():
    tok = byte_level()
    marker = "<tool_call>\n"
    for text, content in [("Let me see.  \n<tool_call>\n{\"a\": 1}\n</tool_call>", "Let me see."),
                          ("<tool_call>\n{}\n</tool_call>", ""),
                          ("a <tool_call>x not a call", "a <tool_call>x not a call")]:
        ids = tok.encode(text, add_special_tokens=False)
        out, _, s = run(tok, ids, marker=marker)
        assert "<" not in out.replace("a <tool_call>x", "") and content.startswith(out)
        assert out + s.finish(content) == content
    # a prefix of the marker at the end is held until it is known not to be one
    s = ChoiceStream(tok, [], (), marker)
    assert s.push(tok.encode("ok <tool", add_special_tokens=False))[0] == "ok"
    assert s.push(tok.encode("s>", add_special_tokens=False))[0] == " <tools>"


def test_invalid_bytes_end_up_in_the_finished_text():
    tok = byte_level()
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(200)]
    full = tok.decode(ids, skip_special_tokens=True)
    out, taken, s = run(tok, ids, valid=False)
    assert full.startswith(out) and taken == 200 and out + s.finish(full) == full


def test_queued_deltas_are_merged_per_choice_in_order():
    import asyncio
    from types import SimpleNamespace

    from mtrain.rollout.protocol import TokenDelta
    from mtrain.serve.sse import StreamedCall

    tok = chatml_tokenizer()
    ids = tok.encode("ab56cd", add_special_tokens=False)
    front = SimpleNamespace(tokenizer=tok, stops=(tok.eos_token_id,))
    job = SimpleNamespace(params=[None, None], stops=[], tool_marker=None)

    async def main():
        call = StreamedCall(front, job)
        call._first = (0, TokenDelta(ids[:1], [-1.0]))
        for item in [(1, TokenDelta(ids[:2], [-2.0, -3.0])), (0, TokenDelta(ids[1:3], [-4.0, -5.0])),
                     (0, TokenDelta(ids[3:], [-6.0] * len(ids[3:]))), None]:
            call._queue.put_nowait(item)
        return [(j, piece, taken, d.logprobs) async for j, piece, taken, d in call.deltas()]

    got = asyncio.run(main())
    assert [(j, piece, taken) for j, piece, taken, _ in got] == [(0, "ab56cd", len(ids)), (1, "ab", 2)]
    assert got[0][3] == [-1.0, -4.0, -5.0] + [-6.0] * len(ids[3:])
