"""Qwen2.5-VL: its config in the flat form the tables read, and the table rows of its vision tower.

The language model of Qwen2.5-VL is Qwen2's decoder (q/k/v bias, no o_proj bias) with multimodal RoPE, so its
rows are the Qwen2 rows (`blocks.gqa_rows`/`dense_mlp_rows`) under the same HF names (`model.layers.*`,
`model.embed_tokens`, `model.norm`, `lm_head`: the names transformers 5.12 writes and the release has).
The vision tower (HF `visual.*`) lives on the Megatron side as transformers' own module under `vision.*`
(mtrain/models/vlm.py, docs/design-vlm.md), replicated over TP: every Megatron part is `Replicated`, and
Megatron names are HF names with `visual.` -> `vision.`.

SGLang 0.5.17 (python/sglang/srt/models/qwen2_5_vl.py, cited as QV:line; layers/attention/vision.py as VA:line):
- parameters keep HF's `visual.` prefix (QV:648-655, prefix "visual"); names are HF's except the attention's
  fused `attn.qkv` -> `attn.qkv_proj` (QV:874-876) and the MLP's gate/up -> `mlp.gate_up_proj` (QV:814-821);
- `attn.qkv_proj` is a QKVParallelLinear with num_heads query and num_heads KV heads (VA:1128-1138): rank r
  holds [q_r; k_r; v_r]; HF's fused tensor is split by SGLang's loader (loaded_shard_id None);
  `attn.proj` is RowParallelLinear (VA:1149-1158): weight split by input features, bias whole;
- the MLP is MergedColumnParallelLinear gate_up + RowParallelLinear down with biases (QV:88-119) over an
  intermediate size rounded up to a multiple of 8 (QV:297; the loader zero-pads, layers/linear.py:703-711,
  1511-1519): the padded rows of [gate_r; up_r] and columns of down_r are zeros;
- `merger.mlp.0` ColumnParallelLinear, `merger.mlp.2` RowParallelLinear (QV:235-257), `merger.ln_q`,
  `norm1`/`norm2` and `patch_embed.proj` (a Conv3d kernel, QV:300-305) replicated;
- the vision tower uses SGLang's attention TP (`attn_tp_size`, VA:1067), which is the engine TP without
  DP attention (the only mode mtrain runs).
"""
from __future__ import annotations

from mtrain.layouts.blocks import norm
from mtrain.layouts.rules import Block, Fused, LayoutError, Split
from mtrain.layouts.table import COL, ROW, Weight, one, stacked

VLM_ARCHS = ("qwen2_5_vl",)
SGLANG_VISION_MLP_PAD = 8  # QV:297: ((intermediate_size + 7) // 8) * 8
MEGATRON_VISION = "vision."
HF_VISION = "visual."


def flat_config(cfg: dict) -> dict:
    """A Qwen2.5-VL config.json (the release's flat form or transformers 5's `text_config` form) as one flat dict:
    the text model's fields at the top (what the tables and the model mapping read), `vision_config` kept."""
    if cfg.get("model_type") not in VLM_ARCHS:
        return cfg
    out = dict(cfg.get("text_config") or {})
    out.update({k: v for k, v in cfg.items() if k != "text_config"})
    if "vision_config" not in out:
        raise LayoutError(f"{cfg['model_type']} config.json has no vision_config")
    return out


def vision_facts(cfg: dict) -> dict:
    """The vision tower's sizes, checked where a layout depends on them."""
    vc = cfg["vision_config"]
    dim, heads = int(vc["hidden_size"]), int(vc["num_heads"])
    if dim % heads:
        raise LayoutError(f"vision_config hidden_size {dim} is not divisible by num_heads {heads}")
    return dict(dim=dim, heads=heads, head_dim=dim // heads, inter=int(vc["intermediate_size"]),
                depth=int(vc["depth"]), out=int(vc["out_hidden_size"]), merge=int(vc.get("spatial_merge_size", 2)),
                patch=int(vc.get("patch_size", 14)), tpatch=int(vc.get("temporal_patch_size", 2)),
                in_ch=int(vc.get("in_channels", 3)))


def _vrow(key: str, shape: tuple, sub: str, sg_rule=None, sg_name: str | None = None) -> Weight:
    """One vision weight held whole by Megatron and HF under `vision.<sub>` / `visual.<sub>`."""
    rows = shape[0]
    sg = one(HF_VISION + (sg_name or sub), rows, sg_rule) if sg_rule is not None else one(HF_VISION + (sg_name or sub), rows)
    return Weight(key, shape, one(MEGATRON_VISION + sub, rows), one(HF_VISION + sub, rows), sg, region="embed")


def vision_rows(cfg: dict) -> list[Weight]:
    f = vision_facts(cfg)
    dim, heads, d, inter = f["dim"], f["heads"], f["head_dim"], f["inter"]
    merged = dim * f["merge"] ** 2
    pad = SGLANG_VISION_MLP_PAD
    qkv_rule = Fused(tuple(Block(heads, d, "vision attention heads", replicable=False) for _ in range(3)))
    gate_up_rule = Fused((Block(inter, 1, "vision intermediate size (gate)", pad),
                          Block(inter, 1, "vision intermediate size (up)", pad)))
    rows = [_vrow("V.patch_embed", (dim, f["in_ch"], f["tpatch"], f["patch"], f["patch"]), "patch_embed.proj.weight")]
    for i in range(f["depth"]):
        b, k = f"blocks.{i}.", f"V{i}."
        rows += [
            norm(k + "norm1", dim, f"{MEGATRON_VISION}{b}norm1.weight", f"{HF_VISION}{b}norm1.weight",
                 f"{HF_VISION}{b}norm1.weight", region="embed"),
            norm(k + "norm2", dim, f"{MEGATRON_VISION}{b}norm2.weight", f"{HF_VISION}{b}norm2.weight",
                 f"{HF_VISION}{b}norm2.weight", region="embed"),
            _vrow(k + "qkv", (3 * dim, dim), b + "attn.qkv.weight", qkv_rule, b + "attn.qkv_proj.weight"),
            _vrow(k + "qkv_bias", (3 * dim,), b + "attn.qkv.bias", qkv_rule, b + "attn.qkv_proj.bias"),
            _vrow(k + "proj", (dim, dim), b + "attn.proj.weight", ROW),
            _vrow(k + "proj_bias", (dim,), b + "attn.proj.bias"),
            _vrow(k + "down", (dim, inter), b + "mlp.down_proj.weight", Split(1, "vision intermediate size", pad)),
            _vrow(k + "down_bias", (dim,), b + "mlp.down_proj.bias"),
        ]
        for kind, shape in (("weight", (2 * inter, dim)), ("bias", (2 * inter,))):
            gu = [(f"{b}mlp.gate_proj.{kind}", inter), (f"{b}mlp.up_proj.{kind}", inter)]
            rows.append(Weight(f"{k}gate_up_{kind}", shape, stacked([(MEGATRON_VISION + n, r) for n, r in gu]),
                               stacked([(HF_VISION + n, r) for n, r in gu]),
                               one(f"{HF_VISION}{b}mlp.gate_up_proj.{kind}", 2 * inter, gate_up_rule), region="embed"))
    rows += [
        norm("V.merger_norm", dim, f"{MEGATRON_VISION}merger.ln_q.weight", f"{HF_VISION}merger.ln_q.weight",
             f"{HF_VISION}merger.ln_q.weight", region="embed"),
        _vrow("V.merger_fc1", (merged, merged), "merger.mlp.0.weight", COL),
        _vrow("V.merger_fc1_bias", (merged,), "merger.mlp.0.bias", COL),
        _vrow("V.merger_fc2", (f["out"], merged), "merger.mlp.2.weight", ROW),
        _vrow("V.merger_fc2_bias", (f["out"],), "merger.mlp.2.bias"),
    ]
    if f["out"] != cfg["hidden_size"]:
        raise LayoutError(f"vision_config out_hidden_size {f['out']} differs from the text hidden_size "
                          f"{cfg['hidden_size']}: image embeddings could not replace token embeddings")
    return rows
