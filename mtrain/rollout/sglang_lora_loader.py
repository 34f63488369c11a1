"""The direct LoRA loader: adapter tensors written straight into SGLang's LoRA memory pool (GPU), in its layout.

`load_lora_adapter_from_tensors` (SGLang's path) moves every tensor to the host, re-stacks it there, registers a new
adapter, and the next request copies it into a pool slot. This loader instead overwrites, in place on the GPU, the
pool slot of an adapter that is already loaded and resident: one custom_weight_loader call
(`update_weights_from_tensor(load_format=LOAD_LORA_DIRECT)`, SGLang's extension point), no registry change.

SGLang's pool layout (sglang/srt/lora/mem_pool.py, lora.py, 0.5.17), per layer and stacked module:
    A_buffer[key][layer][slot, : c*r, :]  = concat over the stacked parts of each part's A (r x in), c parts
    B_buffer[key][layer][slot, :, : r]    = concat over the parts of each part's B (out_part x r), along rows
with key qkv_proj <- (q, k, v), gate_up_proj <- (gate, up), o_proj, down_proj alone; the per-rank slice is the
LoRA module's own (slice_lora_a_weights / slice_lora_b_weights, as SGLang's loader applies); scaling alpha/r is
applied at run time (dense modules). The plan from the adapter table's HF names to (layer, key, A|B, part index)
is `slot_plan` (pure; tested on CPU).

The adapter must be pinned (it is never evicted, so SGLang never reloads the slot from its host copy, which this
loader does not rewrite) and resident (a request has named it). MoE expert adapters are not handled here.
Like mtrain's other loader it never raises inside the scheduler: errors go to the status dir (sglang_loader.py).
"""
from __future__ import annotations

import json
import re
import weakref
from typing import Any, Sequence

LOAD_LORA_DIRECT = "mtrain.rollout.sglang_lora_loader.load_lora_direct"
ADAPTER_MARK = "__mtrain_lora_adapter__"  # + JSON {"name": adapter name}; a zero-size tensor goes with it

# SGLang's stacked LoRA modules: HF linear -> (pool key, part index, parts)
STACKED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
           "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
           "o_proj": ("o_proj", 0, 1), "down_proj": ("down_proj", 0, 1)}
_NAME = re.compile(r"^(?:base_model\.model\.)?(?:.*\.)?layers\.(\d+)\.(?:.*\.)?(\w+_proj)\.(lora_[AB])\.weight$")


class SlotPlanError(ValueError):
    pass


def slot_plan(names: Sequence[str]) -> dict[tuple[int, str, str], list[str]]:
    """(layer, pool key, "lora_A" | "lora_B") -> the HF names of its parts in SGLang's stacking order.
    Refuses names SGLang's dense pool has no slot for (expert adapters, unknown linears) and incomplete stacks."""
    parts: dict[tuple[int, str, str], dict[int, str]] = {}
    counts: dict[tuple[int, str, str], int] = {}
    for n in names:
        m = _NAME.match(n)
        if not m or m.group(2) not in STACKED or ".experts." in n:
            raise SlotPlanError(f"{n!r}: no dense LoRA slot in SGLang's pool for it (expert adapters and linears "
                                f"other than {sorted(STACKED)} are not handled by the direct loader)")
        key, idx, total = STACKED[m.group(2)]
        k = (int(m.group(1)), key, m.group(3))
        if idx in parts.setdefault(k, {}):
            raise SlotPlanError(f"{n!r} given twice")
        parts[k][idx] = n
        counts[k] = total
    out = {}
    for k, got in parts.items():
        if sorted(got) != list(range(counts[k])):
            raise SlotPlanError(f"layer {k[0]} {k[1]} {k[2]}: parts {sorted(got)} of {counts[k]}; SGLang stacks all")
        out[k] = [got[i] for i in range(counts[k])]
    return out


def adapter_marker(name: str):
    import torch
    return (f"{ADAPTER_MARK}{json.dumps({'name': name})}", torch.empty(0))


_managers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _lora_manager(model):
    """The LoRAManager serving `model` in this scheduler process. SGLang hands a custom loader the model only; the
    manager (model_runner.lora_manager) holds it as base_model, so it is found once among the live objects."""
    mgr = _managers.get(model)
    if mgr is None:
        import gc
        from sglang.srt.lora.lora_manager import LoRAManager
        found = [o for o in gc.get_objects() if isinstance(o, LoRAManager) and o.base_model is model]
        if len(found) != 1:
            raise RuntimeError(f"found {len(found)} LoRA managers for this model (is enable_lora set?)")
        mgr = _managers[model] = found[0]
    return mgr


def write_slot(mgr, adapter: str, tensors: dict) -> int:
    """Overwrite adapter `adapter`'s pool slot with `tensors` (HF names -> full, unsliced tensors on this GPU).
    Everything is checked before the first copy. Returns the bytes written on this rank."""
    refs = [r for r in mgr.lora_refs.values() if r.lora_name == adapter]
    if len(refs) != 1:
        raise RuntimeError(f"adapter {adapter!r} is not loaded (loaded: {[r.lora_name for r in mgr.lora_refs.values()]})")
    ref = refs[0]
    if not ref.pinned:
        raise RuntimeError(f"adapter {adapter!r} is not pinned: SGLang could evict it and reload the slot from its "
                           "host copy, which the direct loader does not rewrite")
    slot = mgr.memory_pool.uid_to_buffer_id.get(ref.lora_id)
    if slot is None:
        raise RuntimeError(f"adapter {adapter!r} is not resident in a pool slot yet (run one request under it)")
    r = mgr.loras[ref.lora_id].config.r
    pool = mgr.memory_pool
    writes = []
    for (layer, key, ab), names in slot_plan(list(tensors)).items():
        module = next((m for n, m in mgr.lora_modules[layer].items() if n.endswith("." + key)), None)
        if module is None:
            raise RuntimeError(f"layer {layer} has no LoRA module {key} (lora_target_modules)")
        import torch
        full = torch.cat([tensors[n] for n in names], 0)
        if ab == "lora_A":
            w = module.slice_lora_a_weights(full)
            view = pool.A_buffer[key][layer][slot, : w.shape[0], :]
        else:
            w = module.slice_lora_b_weights(full)
            view = pool.B_buffer[key][layer][slot, :, :r]
        if tuple(view.shape) != tuple(w.shape):
            raise RuntimeError(f"layer {layer} {key} {ab}: slot view {tuple(view.shape)}, tensor {tuple(w.shape)}")
        writes.append((view, w))
    for view, w in writes:
        view.copy_(w, non_blocking=True)
    return sum(w.numel() * w.element_size() for _, w in writes)


def load_lora_direct(model, named_tensors) -> None:
    """SGLang custom weight loader (see the module docstring). named_tensors: adapter_marker(name) + HF names."""
    try:
        marks = [n for n, _ in named_tensors if n.startswith(ADAPTER_MARK)]
        if len(marks) != 1:
            raise RuntimeError(f"expected one {ADAPTER_MARK} entry naming the adapter, got {len(marks)}")
        adapter = json.loads(marks[0][len(ADAPTER_MARK):])["name"]
        write_slot(_lora_manager(model), adapter, {n: t for n, t in named_tensors if not n.startswith(ADAPTER_MARK)})
    except Exception as e:  # noqa: BLE001 - never raise in a scheduler (sglang_loader.py's docstring)
        from mtrain.rollout.sglang_loader import report_error
        report_error(f"load_lora_direct: {type(e).__name__}: {e}")
