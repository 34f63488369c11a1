"""A tiny random Qwen2.5-VL with its own processor, built offline: CI runs images end to end without downloads.

`write_tiny_vlm(out)` writes a complete HF model folder -- config.json, model.safetensors, tokenizer files, the
image processor's preprocessor_config.json and the chat template -- that transformers (AutoTokenizer,
Qwen2VLImageProcessor / AutoProcessor) and SGLang load like a released Qwen2.5-VL checkpoint.

The tokenizer is character-level (a `tokenizers` WordLevel model over printable ASCII) with Qwen's special tokens
in front, so the config's token ids (`image_token_id`, `vision_start_token_id`, ...) are small fixed numbers
declared once here (`SPECIAL_TOKENS`). The chat template is Qwen2.5-VL's own (placeholders
`<|vision_start|><|image_pad|><|vision_end|>` per image), so the prompt path is the one a real checkpoint takes.
"""
from __future__ import annotations

import copy
import json
import string
from pathlib import Path
from typing import Any

import torch

# Order = token id. Qwen2.5-VL's names; ids differ from the released vocabulary (151643...), which is the point:
# nothing may assume the released ids.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
_CHARS = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
# 7 specials + 97 characters: every id the model can emit decodes (transformers drops unknown ids silently); 104 is
# no multiple of 128, so vocab padding is exercised wherever it applies.
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(_CHARS)

# Qwen2.5-VL-Instruct's chat_template (images and text; videos dropped: not supported here).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
    "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

# The image processor's budget for the tiny model: at most 64 merged tokens (256 patches of 14 px) per image.
TINY_MIN_PIXELS = 4 * 28 * 28
TINY_MAX_PIXELS = 64 * 28 * 28

TINY_VLM_CONFIG: dict[str, Any] = dict(
    model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], vocab_size=VOCAB_SIZE,
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
    tie_word_embeddings=False, torch_dtype="float32", initializer_range=0.05,
    # head_dim 16: mrope_section (temporal, height, width) sums to head_dim / 2, unequal parts on purpose
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    bos_token_id=TOKEN_ID["<|endoftext|>"], eos_token_id=TOKEN_ID["<|im_end|>"], pad_token_id=TOKEN_ID["<|endoftext|>"],
    image_token_id=TOKEN_ID["<|image_pad|>"], video_token_id=TOKEN_ID["<|video_pad|>"],
    vision_start_token_id=TOKEN_ID["<|vision_start|>"], vision_end_token_id=TOKEN_ID["<|vision_end|>"],
    # window attention (window 56 px = 2x2 merged tokens) in block 0, full attention in block 1, as the release
    # mixes them; patch/merge/temporal sizes are the release's (the processor and SGLang assume 14/2/2).
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                       tokens_per_second=2, in_chans=3, hidden_act="silu", initializer_range=0.05),
)


# The GPU variant (SGLang): head sizes with a fused rope kernel in SGLang (64; 16 crashes its schedulers, as 32 did
# for Llama: /work/shared/device/README.md) for both the language model and the vision tower.
TINY_VLM_GPU_OVERRIDES: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
    vision_config=dict(TINY_VLM_CONFIG["vision_config"], hidden_size=128, intermediate_size=256, num_heads=2,
                       out_hidden_size=256))


def tiny_vlm_config(**overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY_VLM_CONFIG)
    cfg.update(overrides)
    return cfg


def tiny_vlm_tokenizer():
    """A PreTrainedTokenizerFast: one token per character, Qwen's specials as atomic tokens, Qwen's template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + tuple(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character its own word
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=TINY_VLM_CONFIG["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_vlm_image_processor(max_pixels: int = TINY_MAX_PIXELS, min_pixels: int = TINY_MIN_PIXELS):
    """transformers' Qwen2-VL image processor (PIL backend: no torchvision needed) with a small pixel budget."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = TINY_VLM_CONFIG["vision_config"]
    # `size=` rather than min_pixels/max_pixels: transformers 5.12 writes those into the class-level default dict
    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                    patch_size=v["patch_size"],
                                    temporal_patch_size=v["temporal_patch_size"], merge_size=v["spatial_merge_size"])


def write_tiny_vlm_processor(out: str | Path, *, max_pixels: int = TINY_MAX_PIXELS) -> Path:
    """Tokenizer, chat template and image-processor files into `out` (an existing model folder or a new one).

    preprocessor_config.json names "Qwen2VLImageProcessor" (not the PIL class) so that a machine with torchvision
    (SGLang's) gets the class a released checkpoint gets; processor_config.json names the Qwen2.5-VL processor.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_vlm_tokenizer()
    tok.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    ip = tiny_vlm_image_processor(max_pixels=max_pixels)
    ip.save_pretrained(str(out))
    pre = json.loads((out / "preprocessor_config.json").read_text())
    pre.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor",
               min_pixels=ip.size.shortest_edge, max_pixels=ip.size.longest_edge)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    from mtrain.fileperm import chmod_umask
    for f in out.iterdir():
        chmod_umask(f)
    return out


def write_tiny_vlm(out: str | Path, *, seed: int = 0, overrides: dict | None = None,
                   max_pixels: int = TINY_MAX_PIXELS) -> Path:
    """A random Qwen2_5_VLForConditionalGeneration (float32) and its processor files in `out`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json): refusing to overwrite it")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**tiny_vlm_config(**(overrides or {}))),
                                                        dtype=torch.float32)
    model.save_pretrained(str(out))
    return write_tiny_vlm_processor(out, max_pixels=max_pixels)
