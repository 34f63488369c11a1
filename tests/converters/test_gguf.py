"""GGUF -> HF on the real SmolLM2-135M-Instruct, checked against transformers loading the GGUF itself.

The reference is transformers' own `from_pretrained(gguf_file=)` path (whole model at once, its
own loading and tying); ours streams tensor by tensor into safetensors. They must agree bit for bit.
q/k rows are checked independently: llama.cpp's permutation, written out here from its definition,
must be undone exactly, and the converted model must answer a factual question correctly (with q/k
rows left permuted, rotary embeddings scramble attention and the answer is gibberish).
"""
import json

import numpy as np
import pytest
import torch

from mtrain.converters.safetensors_io import HFCheckpoint
from mtrain.converters.smollm2 import fetch_smollm2_gguf, smollm2_hf_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    return fetch_smollm2_gguf()


@pytest.fixture(scope="module")
def hf_dir(gguf_path):
    # converted once per (GGUF, converter source) and cached: see smollm2_hf_dir
    return smollm2_hf_dir(dtype=torch.float32)


@pytest.fixture(scope="module")
def models(gguf_path, hf_dir):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    return ours, reference


def test_checkpoint_layout(hf_dir):
    ckpt = HFCheckpoint(hf_dir)
    config = ckpt.config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert "lm_head.weight" not in ckpt  # tied: only the embedding is stored
    assert len(ckpt) == 1 + 30 * 9 + 1  # embedding, 9 tensors per layer, final norm
    assert all(ckpt.dtype(n) == torch.float32 for n in ckpt.names())
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_every_tensor_equal(models):
    ours, reference = models
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # still tied
    ours_sd, ref_sd = ours.state_dict(), reference.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    for name in ref_sd:
        assert ours_sd[name].dtype == ref_sd[name].dtype and torch.equal(ours_sd[name], ref_sd[name]), name


def test_logits_equal(models):
    ours, reference = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (3, 24), generator=g)
    with torch.no_grad():
        a, b = ours(ids).logits, reference(ids).logits
    assert a.dtype == torch.float32 and torch.equal(a, b)


def test_qk_permutation_undone(gguf_path, hf_dir):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # llama.cpp's convert_hf_to_gguf.py `permute`: interleave the two rotary halves of each head
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    rng = np.random.default_rng(0)
    for name, rows, heads in (("blk.0.attn_q.weight", 576, 9), ("blk.0.attn_k.weight", 192, 3)):
        w = rng.standard_normal((rows, 576)).astype(np.float32)
        restored = processor.process(weights=llama_cpp_permute(w, heads), name=name).weights
        assert np.array_equal(restored, w), name


def test_model_answers_correctly(models):
    from transformers import AutoTokenizer

    ours, _ = models
    tokenizer = AutoTokenizer.from_pretrained(ours.name_or_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = ours.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer, answer


def test_tokenizer_round_trip(gguf_path, hf_dir):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(hf_dir)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert ours.chat_template == reference.chat_template and "<|im_start|>" in ours.chat_template
    messages = [
        {"role": "system", "content": "You solve arithmetic."},
        {"role": "user", "content": "What is 17 + 25? Answer with a number. ünïcödé 数字 🙂"},
        {"role": "assistant", "content": "42"},
    ]
    text = ours.apply_chat_template(messages, tokenize=False)
    assert text == reference.apply_chat_template(messages, tokenize=False)
    ids = ours(text).input_ids
    assert ids == reference(text).input_ids
    assert ours.decode(ids) == text

    # Special tokens come from the GGUF's own metadata (transformers' GGUF tokenizer gets eos wrong).
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    gguf_id = {k: int(fields[f"tokenizer.ggml.{k}_token_id"].parts[-1][0]) for k in ("bos", "eos", "unknown", "padding")}
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (
        gguf_id["bos"], gguf_id["eos"], gguf_id["unknown"], gguf_id["padding"])
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert ours.model_max_length == 8192
