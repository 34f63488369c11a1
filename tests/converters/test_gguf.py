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
    assert config["architectures"] == ["LlamaForCausalLM"]  # SGLang picks its model class by architectures[0]
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


# --- a tiny GGUF written here from a random HF Llama, the way llama.cpp's converter writes one ---

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `permute`: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {  # HF per-layer suffix -> llama.cpp tensor name
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path to a tiny untied Llama GGUF, the HF state dict it was made from)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads, kv_heads = 4, 2
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         tie_word_embeddings=False)
    state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    for k in state:
        if "norm" in k:  # not all ones, so a swapped norm would show
            state[k] = torch.rand_like(state[k]) + 0.5

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(48)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(64)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [chr(c) for c in range(ord("a"), ord("a") + 26)] + ["Ġ", "ab", "Ġa"]
    tokens += [f"x{i}" for i in range(64 - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (64 - 3))
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for layer in range(2):
        for hf, gg in GGUF_NAMES.items():
            w = state[f"model.layers.{layer}.{hf}"].numpy()
            if gg == "attn_q.weight":
                w = llama_cpp_permute(w, heads)
            elif gg == "attn_k.weight":
                w = llama_cpp_permute(w, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gg}", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_gguf_recovers_hf_weights(tiny_gguf, tmp_path, dtype):
    from transformers import AutoTokenizer

    from mtrain.converters.gguf_to_hf import gguf_to_hf

    path, state = tiny_gguf
    out = gguf_to_hf(path, tmp_path / "hf", dtype=dtype, max_shard_bytes=8 * 1024)
    ckpt = HFCheckpoint(out)
    assert len({str(ckpt.file(n)) for n in ckpt.names()}) > 1  # really sharded
    assert sorted(ckpt.names()) == sorted(state)  # untied: lm_head.weight is written
    assert ckpt.config["tie_word_embeddings"] is False and ckpt.config["dtype"] == str(dtype).split(".")[1]
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    for name, expected in state.items():
        got = ckpt.get(name)
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype)), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<|im_start|>ab<|im_end|>"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_name_map_matches_transformers(model_type):
    # our one-pass GGUF->HF name table equals transformers' own (recursive, slower) one
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from mtrain.converters.gguf_to_hf import _gguf_to_hf_names

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ours = _gguf_to_hf_names(model_type, 2, model.state_dict())
    assert ours == get_gguf_hf_weights_map(model, TensorProcessor())
    assert set(ours.values()) == set(model.state_dict())
