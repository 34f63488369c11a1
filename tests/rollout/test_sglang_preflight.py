"""Engine starts refused before SGLang spends a minute on them (mtrain/rollout/sglang_preflight.py): attention backends
whose sgl_kernel extension the GPU bundle lacks, and rotary head sizes without SGLang's fused rope kernel."""
import json
from pathlib import Path

from mtrain.rollout.sglang_preflight import (extensions_in, missing_kernels, missing_vision_modules, preflight_problems,
                                             rope_head_size, rope_problem, sgl_kernel_extensions)
from mtrain.rollout.sglang_wire import engine_server_args
from mtrain.tiny_configs import tiny_config
from mtrain.tiny_vlm import TINY_VLM_GPU_OVERRIDES, tiny_vlm_config

REPO = Path(__file__).resolve().parents[2]


def _sgl_kernel(tmp_path, *so):
    """An sgl_kernel folder laid out as the GPU bundle's (sglang-0.5.17-device-py312-torch211.tar.xz) plus `so`."""
    for rel in ("sm90/common_ops.abi3.so", "spatial_ops.abi3.so", *so):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    (tmp_path / "flash_attn.py").write_text("")
    return extensions_in([str(tmp_path)])


def _args(**extra):
    return engine_server_args("/m", tp_size=1, mem_fraction_static=0.3, base_gpu_id=0, load_format="dummy",
                              random_seed=0, extra=extra)


def test_our_server_args_and_gpu_models_pass_on_the_bundle(tmp_path):
    bundle = _sgl_kernel(tmp_path)
    assert bundle == {"common_ops", "spatial_ops"}
    gpu_models = [tiny_vlm_config(**TINY_VLM_GPU_OVERRIDES), tiny_config("deepseek_v3_small_gpu"),
                  json.loads((REPO / "examples/deepseek_v3/tiny/gpu_config.json").read_text()),
                  dict(model_type="llama", hidden_size=256, num_attention_heads=4, head_dim=64),
                  dict(model_type="llama", hidden_size=4096, num_attention_heads=32)]  # Llama-8B: 4096 / 32
    assert missing_kernels(_args(), bundle) == []
    for cfg in gpu_models:
        assert rope_problem(cfg) is None, cfg


def test_fa3_and_flashmla_refused_without_their_extension(tmp_path):
    bundle = _sgl_kernel(tmp_path / "bundle")
    msgs = preflight_problems(_args(mm_attention_backend="fa3", decode_attention_backend="flashmla"), None, bundle)
    assert len(msgs) == 2
    assert "decode_attention_backend='flashmla' needs sgl_kernel's flashmla_ops" in msgs[0]
    assert "mm_attention_backend='fa3' needs sgl_kernel's flash_ops" in msgs[1] and "'triton_attn'" in msgs[1]
    full = _sgl_kernel(tmp_path / "full", "flash_ops.abi3.so", "flashmla_ops.abi3.so")
    assert preflight_problems(_args(attention_backend="fa3", decode_attention_backend="flashmla"), None, full) == []
    # no sgl_kernel at all (this CPU box): nothing to say, SGLang's import fails first
    assert sgl_kernel_extensions() is None or "common_ops" in sgl_kernel_extensions()
    assert preflight_problems(_args(attention_backend="fa3"), None, None) == []


def test_rope_head_sizes_that_crashed_the_schedulers_are_refused():
    assert rope_head_size(tiny_config("deepseek_v3")) == 8  # MLA: qk_rope_head_dim, not head_dim
    assert rope_head_size({"text_config": {"hidden_size": 2048, "num_attention_heads": 16}}) == 128
    for cfg, size in ((dict(model_type="llama", hidden_size=128, num_attention_heads=4), 32),  # device README
                      (tiny_vlm_config(), 16)):  # the CPU tiny VLM (mtrain/tiny_vlm.py)
        assert f"rotary head size {size} has no fused rope kernel" in rope_problem(cfg)
    (msg,) = preflight_problems(_args(), dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128,
                                             num_attention_heads=4), None)
    assert "rotary head size 32" in msg
    # sizes above 64 without the fused kernel never ran on the GPU: not refused on a guess
    assert rope_problem(dict(model_type="llama", hidden_size=3072, num_attention_heads=32)) is None  # head 96


def test_fused_qk_norm_rope_with_another_yarn_factor_is_refused():
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)  # max_position_embeddings 256
    moe = dict(tiny_config("qwen3_moe", rope_scaling=yarn), head_dim=64)
    assert preflight_problems(_args(enable_fused_qk_norm_rope=True), moe, None) == []  # 256 / 64 = 4: the same
    (msg,) = preflight_problems(_args(enable_fused_qk_norm_rope=True), dict(moe, max_position_embeddings=128), None)
    assert msg.startswith("enable_fused_qk_norm_rope: SGLang's fused Qwen3-MoE kernel computes yarn with factor "
                          "max_position_embeddings / original_max_position_embeddings = 128/64, not the rope_scaling "
                          "factor 4.0")
    assert preflight_problems(_args(), dict(moe, max_position_embeddings=128), None) == []  # off: the unfused path


def test_vision_model_needs_its_python_packages():
    vlm = tiny_vlm_config(**TINY_VLM_GPU_OVERRIDES)
    assert missing_vision_modules(vlm, ("json", "mtrain_no_such_module")) == ["mtrain_no_such_module"]
    assert missing_vision_modules(tiny_config("deepseek_v3"), ("mtrain_no_such_module",)) == []  # text model


def test_fp8_engine_with_cuda_graphs_passes_the_preflight():
    """Our FP8 engine arguments (rollout/fp8_engine.SERVER_ARGS) keep CUDA graphs off, as all our engines do; turning
    them back on is no longer refused before the start: whether the graphs captured dummy KV scales depends on the
    model's SGLang code and is checked at the first sync (sglang_loader.check_graph_kv_scales)."""
    from mtrain.rollout.fp8_engine import SERVER_ARGS
    assert preflight_problems(_args(**SERVER_ARGS), None, None) == []
    assert preflight_problems(_args(**SERVER_ARGS, disable_cuda_graph=False), None, None) == []
