"""The download-free character tokenizer: ids in range, round trips, its chat template, a tiny HF model."""
import random
import string

import jinja2
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtrain.data import CharTokenizer, make_arithmetic_splits, render_prompt
from mtrain.data.tiny_tokenizer import CHAT_TEMPLATE


def test_round_trip_and_special_tokens():
    tok = CharTokenizer(128)
    text = "What is 17 + 25? Answer with just the number.\n{x: [1, 2]}"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("1<eos>", add_special_tokens=False) == [tok.encode("1", False)[0], tok.eos_token_id]
    assert tok(["ab", "c"])["input_ids"] == [tok.encode("ab"), tok.encode("c")]
    assert tok.batch_decode(torch.tensor([[5, 6], [7, 8]])) == ["1" + "2", "3" + "4"]


@pytest.mark.parametrize("vocab_size", [22, 40, 64, 100, 128, 1000])
def test_every_id_is_below_vocab_size(vocab_size):
    tok = CharTokenizer(vocab_size)
    rng = random.Random(vocab_size)
    text = "".join(rng.choice(string.printable + "é€") for _ in range(2000))
    ids = tok.encode(text)
    assert max(ids) < vocab_size and min(ids) >= 0 and len(tok) == vocab_size
    # digits and operators always survive, whatever the vocabulary size: the arithmetic task needs them
    assert tok.decode(tok.encode("12 + 30 = 42?", False)) == "12 + 30 = 42?"


def test_chat_template_string_matches_the_python_rendering():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    for gen in (True, False):
        rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=gen)
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == rendered
    text, ids = render_prompt(tok, "What is 1 + 2?", system_prompt="Be brief.")
    assert text == "<bos>system: Be brief.\nuser: What is 1 + 2?\nassistant:"
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == ids  # tokenize=True by default, as HF


def test_bad_inputs():
    with pytest.raises(ValueError, match="vocab_size must be >= 22"):
        CharTokenizer(16)
    with pytest.raises(ValueError, match=r"id 64 is outside the vocabulary \[0, 64\)"):
        CharTokenizer(64).decode([5, 64])


def test_drives_a_tiny_random_hf_model():
    torch.manual_seed(0)
    tok = CharTokenizer(64)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    sample = make_arithmetic_splits(1, 0, seed=0)[0][0]
    _, ids = render_prompt(tok, sample.prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=True, top_k=0,
                             pad_token_id=tok.pad_token_id)
    new = out[0, len(ids):]
    assert 1 <= len(new) <= 5 and int(new.max()) < 64
    assert isinstance(tok.decode(new, skip_special_tokens=True), str)
