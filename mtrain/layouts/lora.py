"""Table rows for LoRA adapters, derived from the base model's rows (never spelled a second time).

A LoRA target is a linear weight of the base table, named as the table names it without the layer prefix:
``qkv``, ``o_proj``, ``gate_up``, ``down``, ``experts`` (every routed expert's gate_up and down),
``shared.gate_up``, ``shared.down``. For each target weight W (out x in) the adapter is ``W + s * B @ A``
with ``s = alpha / rank``.

A fused weight (qkv, gate_up) is held by HF/PEFT as separate linears (q/k/v, gate/up), each with its own A
and B. The adapter keeps that structure: one *slice* per HF part, each slice its own A (r x in) and B
(rows_of_part x r). That is what makes the merged Megatron weight equal PEFT's merge for any adapter values
(one shared A could not express three independent ones). The slice's B is sharded the way the base weight
shards those rows (heads for q, KV heads for k/v, the gate or up half of fc1), so its rows land exactly where
the base output's rows are on every TP rank (mtrain/models/lora.py builds the row order from these rules).

Column-parallel base (output rows split): A replicated, B split like the base rows.
Row-parallel base (input columns split, ``Split(1)``): A split by input columns like the base, B replicated.

Megatron names: ``<base module>.lora.<slice>.A`` / ``.B`` for a fused weight, ``<base module>.lora.A`` / ``.B``
otherwise. HF names are PEFT's (without the ``base_model.model.`` prefix its files add): ``<hf linear>.lora_A.weight``.
Adapters have no SGLang parameter rows: SGLang holds them in its LoRA memory pool, not as model parameters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mtrain.layouts.rules import Block, Fused, GroupedQKV, LayoutError, Replicated, Split
from mtrain.layouts.table import ModelLayout, Part, Weight, one
from mtrain.config_checks import LORA_TARGETS

TARGETS = LORA_TARGETS
_KEY = re.compile(r"^L(\d+)\.(?:(E\d+)\.)?(.+)$")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def target_of(w: Weight) -> str | None:
    """The LoRA target name of a base weight row, or None when it cannot carry an adapter."""
    m = _KEY.match(w.key)
    if not m:
        return None
    _, expert, rest = m.groups()
    if expert:
        return "experts" if rest in ("gate_up", "down") else None
    return rest if rest in TARGETS else None


def _slice_name(hf_name: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight' -> 'q'; 'mlp.gate_proj.weight' -> 'gate'."""
    return hf_name.rsplit(".", 2)[-2].removesuffix("_proj")


def _b_rules(rule, n: int):
    """The per-slice rule of B's rows given the base weight's Megatron rule over all slices' rows."""
    if isinstance(rule, GroupedQKV):
        return [Fused((Block(rule.heads, rule.head_dim, "attention heads"),)),
                Fused((Block(rule.groups, rule.head_dim, "KV heads"),)),
                Fused((Block(rule.groups, rule.head_dim, "KV heads"),))]
    if isinstance(rule, Fused):
        if len(rule.blocks) != n:
            raise LayoutError(f"fused rule has {len(rule.blocks)} parts, HF has {n} linears")
        return [Fused((b,)) for b in rule.blocks]
    if isinstance(rule, (Replicated, Split)) and n == 1:
        return [rule]
    raise LayoutError(f"no LoRA row rule for a base weight sharded by {rule!r} over {n} HF parts")


def _module_name(part_name: str) -> str:
    if not part_name.endswith(".weight"):
        raise LayoutError(f"LoRA target {part_name!r} is not a '.weight' parameter (TE grouped experts?)")
    return part_name[: -len(".weight")]


def adapter_rows(w: Weight, rank: int) -> list[Weight]:
    """The A/B rows of one base weight."""
    (mg,) = w.megatron
    module = _module_name(mg.name)
    out_rows, in_cols = w.shape2d
    row_parallel = isinstance(mg.rule, Split) and mg.rule.dim == 1
    hf = w.hf
    b_rules = [Replicated()] if row_parallel else _b_rules(mg.rule, len(hf))
    fused = len(hf) > 1
    rows = []
    for part, b_rule in zip(hf, b_rules):
        sl = f".{_slice_name(part.name)}" if fused else ""
        n = part.rows[1] - part.rows[0]
        hf_mod = _module_name(part.name)
        key = f"{w.key}.lora{sl}"
        common = dict(region=w.region, layer=w.layer, expert=w.expert)
        rows.append(Weight(f"{key}.A", (rank, in_cols),
                           one(f"{module}.lora{sl}.A", rank, Split(1, "input features") if row_parallel else Replicated()),
                           one(f"{hf_mod}.lora_A.weight", rank), (), **common))
        rows.append(Weight(f"{key}.B", (n, rank), one(f"{module}.lora{sl}.B", n, b_rule),
                           one(f"{hf_mod}.lora_B.weight", n), (), **common))
    if sum(p.rows[1] - p.rows[0] for p in hf) != out_rows:
        raise LayoutError(f"{w.key}: HF parts do not cover the weight's rows")
    return rows


def check_targets(targets: tuple[str, ...]) -> None:
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise LayoutError(f"unknown LoRA target(s) {bad}; the layout tables name: {', '.join(TARGETS)}")
    if not targets:
        raise LayoutError("no LoRA targets given")


def lora_layout(base: ModelLayout, spec: LoraSpec) -> ModelLayout:
    """A ModelLayout holding only the adapter rows (same placement facts as the base)."""
    check_targets(spec.targets)
    if spec.rank <= 0:
        raise LayoutError(f"LoRA rank must be positive (got {spec.rank})")
    rows, found = [], set()
    for w in base.weights:
        t = target_of(w)
        if t in spec.targets:
            found.add(t)
            rows += adapter_rows(w, spec.rank)
    missing = [t for t in spec.targets if t not in found]
    if missing:
        raise LayoutError(f"LoRA target(s) {missing} match no layer of this {base.arch} model")
    meta = dict(base.meta, lora={"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)})
    return replace(base, weights=rows, meta=meta)


def with_adapters(base: ModelLayout, spec: LoraSpec) -> ModelLayout:
    """Base rows plus adapter rows: the table of a LoRA model's every Megatron parameter."""
    return replace(base, weights=base.weights + lora_layout(base, spec).weights)


def peft_target_modules(layout: ModelLayout) -> list[str]:
    """PEFT's target_modules (the HF linear names' last component) for an adapter table."""
    return sorted({p.name.rsplit(".", 3)[-3] for w in layout.weights for p in w.hf})


def peft_module_paths(layout: ModelLayout) -> list[str]:
    """The adapted modules by their last two HF name components (`self_attn.q_proj`, `mlp.gate_proj`,
    `shared_experts.gate_proj`): PEFT matches a target by name suffix, so these tell a dense MLP's linears from a MoE
    block's shared experts', which the last component alone (`gate_proj`) does not."""
    return sorted({peft_module_path(p.name) for w in layout.weights for p in w.hf})


def peft_module_path(hf_name: str) -> str:
    """'model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight' -> 'shared_experts.gate_proj'."""
    return ".".join(hf_name.rsplit(".", 4)[-4:-2])


def module_slices(layout: ModelLayout) -> dict[str, list[tuple[str, Weight, Weight]]]:
    """Megatron base module name template -> [(slice name or '', A row, B row)] in the base weight's HF order."""
    out: dict[str, list] = {}
    by_key = layout.by_key()
    for w in layout.weights:
        if not w.key.endswith(".A"):
            continue
        b = by_key[w.key[:-2] + ".B"]
        name = w.megatron[0].name  # "<module>.lora[.<slice>].A"
        module, _, rest = name.partition(".lora")
        out.setdefault(module, []).append((rest.strip(".").removesuffix("A").strip("."), w, b))
    return out


META_FILE = "lora.json"  # next to a dist checkpoint's files: the adapters' rank, alpha and targets


def write_meta(mcore_dir, spec: LoraSpec) -> None:
    import json
    from pathlib import Path
    (Path(mcore_dir) / META_FILE).write_text(json.dumps(
        {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}, indent=2) + "\n")


def read_meta(mcore_dir) -> LoraSpec | None:
    """The LoraSpec a checkpoint was trained with, or None for a checkpoint without adapters."""
    import json
    from pathlib import Path
    f = Path(mcore_dir) / META_FILE
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return LoraSpec(int(d["rank"]), float(d["alpha"]), tuple(d["targets"]))
