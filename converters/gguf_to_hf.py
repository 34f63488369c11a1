"""GGUF -> HF checkpoint (config, generation config, sharded safetensors, tokenizer with chat template).

Dequantisation and name mapping are transformers' own (the code behind `from_pretrained(gguf_file=)`):
its tensor processor undoes llama.cpp's interleaving of q/k rows for rotary embeddings
(`LlamaTensorProcessor._reverse_permute_weights`). We call those pieces one tensor at a time and
stream each into a ShardedWriter, so only one dequantised tensor is in memory at once, where
`from_pretrained` would dequantise the whole model first.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import ConvertError, UnsupportedModelError
from .hf_config_file import complete_config_file
from .safetensors_io import ShardedWriter, check_output_dir

# Architectures whose transformers tensor processor maps each GGUF tensor to exactly one HF tensor.
# (MoE processors fuse experts into transformers 5's in-memory 3-D layout, which is not the on-disk
# per-expert layout HF checkpoints use; they are refused rather than written wrong.)
# (Mistral GGUFs declare "llama": llama.cpp has no separate architecture for them.)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert a GGUF file to a HF checkpoint directory at `out_dir`; return `out_dir`."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConvertError(f"GGUF file {gguf_path} does not exist")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConvertError(f"dtype {dtype} is not supported for a HF checkpoint (float32, bfloat16, float16)")
    check_output_dir(out_dir, overwrite)  # fail before the slow parts, not after them

    # Imported here, after the cheap checks: transformers takes seconds to import.
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor,
    )

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # gguf raises bare ValueErrors/struct errors on corrupt files
        raise ConvertError(f"{gguf_path}: not a readable GGUF file: {e}") from e
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ConvertError(f"{gguf_path}: GGUF metadata lacks general.architecture")
    architecture = bytes(arch_field.parts[-1]).decode()
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_path}: GGUF architecture '{architecture}' is not supported by gguf_to_hf "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config.dtype = dtype
    generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    _set_special_tokens_from_gguf(tokenizer, reader)
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    # transformers ignores this for BPE tokenizers anyway (and warns on every load if it is True).
    tokenizer.clean_up_tokenization_spaces = False

    # Same steps as from_pretrained(gguf_file=): a meta-device model only provides the HF names.
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in meta_model.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:  # tied: the checkpoint holds the embedding only, as HF's own tied checkpoints do
        expected.pop("lm_head.weight", None)
    # The processors read head counts by their HF names from a dict: the HF config provides them
    # (parsing the GGUF metadata once more with load_gguf_checkpoint would cost seconds).
    parsed_config = config.to_dict()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed_config)
    name_map = _gguf_to_hf_names(architecture, config.num_hidden_layers, meta_model.state_dict())

    writer = ShardedWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    with writer:
        unmapped = []
        for tensor in tqdm(reader.tensors, desc=f"gguf -> hf ({gguf_path.name})", unit="tensor"):
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=name_map,
                                       parsed_parameters={"tensors": {}, "config": parsed_config})
            if result.name not in name_map:
                unmapped.append(tensor.name)
                continue
            hf_name = name_map[result.name]
            if hf_name not in expected:  # e.g. an lm_head that is tied to the embedding
                unmapped.append(tensor.name)
                continue
            # Unquantised (F32) GGUF tensors are read-only views of the mapped file: copy those.
            out = torch.from_numpy(np.require(result.weights, requirements=["C", "W"])).to(dtype)
            if tuple(out.shape) != expected[hf_name]:
                raise ConvertError(
                    f"{gguf_path}: tensor '{tensor.name}' -> '{hf_name}' has shape {list(out.shape)}, "
                    f"the model expects {list(expected[hf_name])}"
                )
            writer.add(hf_name, out)
            expected.pop(hf_name)
        if expected:
            raise ConvertError(
                f"{gguf_path}: the GGUF lacks {len(expected)} tensors the HF model needs, e.g. '{next(iter(expected))}'"
            )
        if unmapped:
            logging.getLogger(__name__).info("GGUF tensors without a HF counterpart, skipped: %s", unmapped)
        config.save_pretrained(writer.path)
        complete_config_file(writer.path / "config.json")
        generation_config.save_pretrained(writer.path)
        tokenizer.save_pretrained(writer.path)
    return writer.out_dir


def _gguf_to_hf_names(architecture: str, num_layers: int, hf_state: dict) -> dict[str, str]:
    """GGUF tensor name -> HF name, from gguf's own name table.

    transformers' get_gguf_hf_weights_map gives the same answer for the supported architectures
    but rebuilds gguf's table once per submodule (~400 times, several seconds for SmolLM2); the
    top-level pass is all that plain decoder models need. A name left unmapped is caught by the
    "GGUF lacks tensors the HF model needs" check.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    table = get_tensor_name_map(arch, num_layers)
    mapping = {}
    for hf_name in hf_state:
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        gguf_base = table.get_name(base)
        if gguf_base is not None:
            mapping[gguf_base + dot + suffix] = hf_name
    return mapping


# GGUF metadata key -> tokenizer special-token attribute
_SPECIAL_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
}


def _set_special_tokens_from_gguf(tokenizer, reader) -> None:
    """Take bos/eos/unk/pad from the GGUF's own ids.

    transformers 5.12.1's GGUF BPE converter sets eos to the *bos* token (integrations/ggml.py:
    `eos_token = proto.tokens[proto.bos_token_id]`) and drops pad; for SmolLM2 that makes eos
    `<|im_start|>` instead of `<|im_end|>`, so generation would never stop at the end of a turn.
    """
    for key, attr in _SPECIAL_TOKEN_KEYS.items():
        field = reader.fields.get(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if not 0 <= token_id < len(tokenizer):
            raise ConvertError(f"GGUF {key} = {token_id} is outside the vocabulary ({len(tokenizer)} tokens)")
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
