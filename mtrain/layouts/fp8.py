"""SGLang's block-FP8 parameter layout (quantization="fp8", weight_block_size [128, 128]; SGLang 0.5.17).

Which weights are FP8 is a column of the layout tables (`Weight.block_fp8`: every linear layer's weight; the
embedding, head, norms, biases and routers stay in the model dtype). This module holds the rest of the layout:
- per rank, a block-FP8 parameter `X` (`...weight`, FusedMoE `w13_weight` / `w2_weight`) is float8_e4m3fn with
  the shape of its bf16 twin, and `X + "_scale_inv"` is float32 [slots,] ceil(rows/128) x ceil(cols/128)
  (layers/quantization/fp8.py, create_fp8_weight_ and create_fp8_moe_weight_);
- the divisibility rules SGLang enforces when it builds the layers (`validate_block_quant_shapes`; FusedMoE:
  `intermediate_size_per_partition % 128`), checked here at planning time so that a bad engine TP is refused with
  one clear error naming the weight, before any engine starts;
- the block math: scale = amax(|block|) / 448 as the IEEE float32 quotient, values e4m3fn(clamp(float32(x /
  scale))) rounded to nearest even (mtrain.kernels.fp8; DeepSeek's release format);
- what SGLang does to these parameters after loading them: nothing, on CUDA sm90 with the engine arguments mtrain
  uses (`rollout/fp8_engine.SERVER_ARGS`: fp8_gemm_runner_backend "triton"; the device bundle has no deep_gemm).
  So the checkpoint's tensors, fused and sliced by the loader, are what the engine holds, and a sync writes exactly
  those. The transforms SGLang has, all off there (docs/fp8.md, "After load", cites the lines): UE8M0 requantization
  of scales for DeepGEMM (Blackwell only: DEEPGEMM_SCALE_UE8M0), ROCm's e4m3fnuz normalisation, MXFP8 conversion,
  CPU/AMX and Marlin (sm80-88) repacking, aiter shuffles. One of them on (another GPU, DeepGEMM forced) changes the
  dtype, shape or layout the engine-side loader checks, or marks the scale `format_ue8m0` (REQUANTIZED_MARK):
  the sync is then refused with one clear error instead of writing a format SGLang no longer reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtrain.kernels.fp8 import SCALINGS, scale_shape  # noqa: F401 (SCALINGS: engine.fp8_scaling's resolved values)
from mtrain.kernels.fp8_channel import channel_block, channel_scale_shape
from mtrain.layouts.rules import Fused, LayoutError, Split
from mtrain.layouts.table import Part, Weight

BLOCK = (128, 128)  # weight_block_size of DeepSeek-V3's and Qwen3's FP8 releases; the only one SGLang's path takes
SCALE_SUFFIX = "_scale_inv"
# Per-channel FP8 (engine.fp8_scaling=channel): SGLang's own quantization of a bf16 model (quantization="fp8"
# without a serialized checkpoint; layers/quantization/fp8.py:826-860, kernels/fp8_channel.py): `weight` becomes
# float8_e4m3fn [N, K] storage seen as its transpose [K, N], `weight_scale` float32 [1, N], one scale per output row
# of the per-rank weight; no divisibility rule. FusedMoE experts get one scale per expert instead (Fp8MoEMethod:
# scaled_fp8_quant per expert), a third format mtrain does not write: refused (check_channel_split).
CHANNEL_SCALE_SUFFIX = "_scale"
# The attribute SGLang sets on a scale it requantized to UE8M0 after load (fp8_utils.requant_block_scale_ue8m0_for_
# deepgemm, the MoE/linear process_weights_after_loading): such a layer no longer holds amax/448 float32 scales.
REQUANTIZED_MARK = "format_ue8m0"


@dataclass(frozen=True)
class Fp8Param:
    """The scale that goes with one block-FP8 destination parameter."""

    scale_name: str
    scale_shape: tuple[int, ...]
    block: tuple[int, int] = BLOCK
    scaling: str = "block"  # "channel": block is (1, cols), the engine's parameter is the transposed view


def fp8_param(name: str, shape: tuple[int, ...], block: tuple[int, int] = BLOCK, scaling: str = "block") -> Fp8Param:
    """The scale of FP8 weight `name` ([N, K] per rank, or [E, N, K]) under `scaling`."""
    if not name.endswith("weight"):
        raise LayoutError(f"{name}: only weights are FP8 in SGLang's layout")
    if scaling == "channel":
        return Fp8Param(name + CHANNEL_SCALE_SUFFIX, channel_scale_shape(tuple(shape)), channel_block(shape[-1]),
                        "channel")
    return Fp8Param(name + SCALE_SUFFIX, scale_shape(tuple(shape), block), block)


def check_channel_split(w: Weight, part: Part) -> None:
    """Refuse what per-channel FP8 cannot hold: FusedMoE experts (SGLang quantizes them per expert, not per row)."""
    if part.slot:
        raise LayoutError(f"{w.key} ({part.name}): per-channel FP8 is for dense linear layers; SGLang quantizes a "
                          "bf16 model's FusedMoE experts with one scale per expert (Fp8MoEMethod), which mtrain does "
                          "not write: use engine.fp8_scaling=block")


def _per_rank_rows(rule: Fused, world: int) -> list[int]:
    return [(b.units // world if b.units >= world else 1) * b.unit_rows for b in rule.blocks]


def check_block_split(w: Weight, part: Part, shard: tuple[int, int], world: int, block: tuple[int, int] = BLOCK) -> None:
    """Refuse a shard SGLang's FP8 layers refuse. `shard` is the per-rank (rows, cols) of the 2-D weight, `world`
    the parallel size that splits it (attention TP for linear layers, MoE TP for experts)."""
    bn, bk = block
    rule = part.rule

    def need(n: int, b: int, what: str) -> None:
        if n % b:
            raise LayoutError(f"{w.key} ({part.name}): block-FP8 needs {what} divisible by {b} per engine rank, got "
                              f"{n} at parallel size {world} (SGLang refuses it at engine start: "
                              "layers/quantization/fp8.py); use another engine tp/ep, or engine.weight_dtype=auto")

    if part.slot:  # FusedMoE: intermediate_size_per_partition % block_n always, % block_k too at tp > 1
        inter = shard[0] // 2 if isinstance(rule, Fused) else shard[1]
        need(inter, bn, "the expert intermediate size (gate/up rows, down cols)")
        if world > 1:
            need(inter, bk, "the expert intermediate size (down cols)")
        return
    if isinstance(rule, Fused):  # merged (several parts) always; a single fused part is column parallel
        if len(rule.blocks) > 1 or world > 1:
            for n, b in zip(_per_rank_rows(rule, world), rule.blocks):
                need(n, bn, f"the rows of each fused part ({b.what})")
    elif isinstance(rule, Split) and world > 1:
        if rule.dim == 0:
            need(shard[0], bn, "the output rows (column parallel)")
        else:
            need(shard[1], bk, "the input columns (row parallel)")
