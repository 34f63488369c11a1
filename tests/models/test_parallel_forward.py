"""forward_logits under TP2, PP2, PP2+VPP2, EP2, TP2xEP2 (ETP 1 and 2) equals the TP1 logits of the same weights.

The reference rank loads HF weights into a TP1 model (tests/models/hf_reference.py), checks it against
transformers, and saves a Megatron dist checkpoint. Every parallel layout then loads that checkpoint
through Megatron's own resharding (dist_checkpointing) and must reproduce the same logits on its last
pipeline stage. Bad layouts must fail with one error naming the setting.
"""
from __future__ import annotations

import os

import pytest
import torch

from mtrain.dist import run_on_ranks

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
MOE = ("qwen3_moe", "deepseek_v3")
TOL = 1e-4


def _tokens() -> torch.Tensor:
    return torch.randint(0, 250, (3, 10), generator=torch.Generator().manual_seed(7))


def _save_reference(rank: int, world: int, root: str) -> dict:
    from hf_reference import hf_to_megatron_tp1, make_hf_model
    from megatron.core import dist_checkpointing

    from mtrain.dist import init_distributed
    from mtrain.models import build_model, forward_logits, model_sharded_state_dict
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed()
    diffs = {}
    for arch in ARCHS:
        hf_config = tiny_config(arch)
        chunks, _ = build_model(hf_config)
        hf = make_hf_model(hf_config)
        chunks[0].load_state_dict(hf_to_megatron_tp1(hf, hf_config, chunks[0].state_dict()))
        logits = forward_logits(chunks, _tokens())
        with torch.no_grad():
            diffs[arch] = float((logits - hf(_tokens()).logits).abs().max())
        os.makedirs(f"{root}/{arch}")
        dist_checkpointing.save(model_sharded_state_dict(chunks), f"{root}/{arch}")
        torch.save(logits, f"{root}/{arch}.logits.pt")
    return diffs


def _forward_layout(rank: int, world: int, root: str, layout: dict, archs: tuple) -> dict:
    from megatron.core import dist_checkpointing

    from mtrain.dist import init_distributed
    from mtrain.models import build_model, forward_logits, model_sharded_state_dict
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed(**layout)
    out = {}
    for arch in archs:
        chunks, _ = build_model(tiny_config(arch), vpp=layout.get("vpp"))
        loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), f"{root}/{arch}")
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"chunk{i}"])
        logits = forward_logits(chunks, _tokens())
        if logits is None:
            out[arch] = None
        else:
            out[arch] = float((logits - torch.load(f"{root}/{arch}.logits.pt")).abs().max())
    return out


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mcore_ref")
    diffs = run_on_ranks(_save_reference, 1, str(root), timeout=600)[0]
    for arch, d in diffs.items():
        assert d < TOL, f"{arch}: TP1 reference differs from transformers by {d:.3e}"
    return str(root)


LAYOUTS = {
    "tp2": (2, dict(tp=2), ARCHS),
    "pp2": (2, dict(pp=2), ARCHS),
    "pp2_vpp2": (2, dict(pp=2, vpp=2), ("llama", "qwen3_moe", "deepseek_v3")),
    "ep2": (2, dict(ep=2), MOE),
    "tp2_ep2_etp1": (2, dict(tp=2, ep=2, etp=1), MOE),
    "tp2_ep2_etp2_dp2": (4, dict(tp=2, ep=2), MOE),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_logits_equal_tp1(reference_dir, layout):
    world, sizes, archs = LAYOUTS[layout]
    per_rank = run_on_ranks(_forward_layout, world, reference_dir, sizes, archs, timeout=600)
    pp = sizes.get("pp", 1)
    last_stage_ranks = [r for r in range(world) if r // (world // pp) == pp - 1]
    for r, result in enumerate(per_rank):
        for arch in archs:
            if r in last_stage_ranks:
                assert result[arch] is not None and result[arch] < TOL, f"{layout} rank {r} {arch}: {result[arch]}"
            else:
                assert result[arch] is None, f"{layout} rank {r} is not a last stage but returned logits"


def _bad_build(rank: int, world: int, layout: dict, arch: str, changes: dict) -> str:
    from mtrain.dist import init_distributed
    from mtrain.models import ModelConfigError, build_model
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed(**layout)
    try:
        build_model(tiny_config(arch, **changes))
    except ModelConfigError as err:
        return str(err)
    return "no error"


BAD = {
    "heads_vs_tp": (dict(tp=2), "qwen3", dict(num_attention_heads=3, num_key_value_heads=3), "num_attention_heads=3"),
    "kv_heads_vs_tp": (dict(tp=2), "llama", dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads=3"),
    "experts_vs_ep": (dict(ep=2), "qwen3_moe", dict(num_experts=5), "num_experts=5"),
    "ep_on_dense": (dict(ep=2), "llama", {}, "expert_model_parallel_size=2"),
}


def test_bad_layouts_name_the_setting():
    cases = list(BAD.values())
    messages = run_on_ranks(_bad_builds, 2, cases, timeout=300)
    for (layout, arch, changes, needle), msg in zip(cases, messages[0]):
        assert needle in msg, f"{arch} {layout} {changes}: error {msg!r} does not name {needle!r}"


def _bad_builds(rank: int, world: int, cases: list) -> list[str]:
    # init_distributed re-creates parallel_state on the live process group for each layout.
    return [_bad_build(rank, world, layout, arch, changes) for layout, arch, changes, _ in cases]


def test_unknown_model_type_is_one_clear_error():
    from mtrain.models import ModelConfigError, map_hf_config

    with pytest.raises(ModelConfigError, match="model_type='gpt_neox' is not supported"):
        map_hf_config({"model_type": "gpt_neox", "hidden_size": 64})


@pytest.mark.parametrize(
    "arch, changes, needle",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq_factor"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
        ("deepseek_v3", {"topk_group": 1}, "topk_group"),
        ("qwen3", {"num_hidden_layers": None}, "num_hidden_layers"),
    ],
)
def test_unmappable_fields_are_named(arch, changes, needle):
    from mtrain.models import ModelConfigError, map_hf_config
    from mtrain.tiny_configs import numerics_config as tiny_config

    with pytest.raises(ModelConfigError, match=needle):
        map_hf_config(tiny_config(arch, **changes))
