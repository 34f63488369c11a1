"""Adapter-only sync into SGLang against a full weight sync of the same model (GPU, SGLang 0.5.17).

    python benchmarks/gpu_lora_sync.py [--model smollm2|HF_DIR] [--rank 32] [--repeats 10]

Starts one sglang.Engine with enable_lora / max_lora_rank / lora_target_modules (the names the adapter table gives,
mtrain/layouts/lora.py), then per repeat:
  full:     engine.update_weights_from_tensors(every HF weight)              (what a full-fine-tuning sync moves)
  adapters: engine.load_lora_adapter_from_tensors("policy-v{n}", A/B tensors)  + unload of version n-1
  direct:   engine.update_weights_from_tensor(A/B tensors on the GPU, load_format=LOAD_LORA_DIRECT): mtrain's loader
            overwrites a pinned, resident adapter's LoRA pool slot in place (mtrain/rollout/sglang_lora_loader.py)
Prints bytes and milliseconds (median, min-max over the repeats) of each and their ratio. Then checks generation:
greedy tokens under the tensors-loaded adapter and under the directly written one equal those under the same
adapter loaded from a PEFT directory written by the adapter table's names (a fresh load), and differ from the base
model's (the adapter is applied).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def adapter_tensors(hf_config: dict, rank: int, alpha: float, targets: tuple[str, ...], seed: int = 0):
    """PEFT-named random adapter (B nonzero) for every row of the adapter table, and its PEFT config dict."""
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout, peft_target_modules

    table = lora_layout(model_layout(hf_config, mtp=False), LoraSpec(rank, alpha, targets))
    g = torch.Generator().manual_seed(seed)
    tensors = {f"base_model.model.{w.hf[0].name}": (0.02 * torch.randn(w.shape, generator=g)).to(torch.bfloat16)
               for w in table.weights}
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": peft_target_modules(table),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    return tensors, config


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def spread(ms: list[float]) -> str:
    return f"{statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}, n={len(ms)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--targets", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import os
    import sglang
    from safetensors.torch import load_file, save_file
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    from mtrain.rollout.sglang_loader import STATUS_DIR_ENV, collect_errors
    from mtrain.rollout.sglang_lora_loader import LOAD_LORA_DIRECT, adapter_marker

    if args.model == "smollm2":
        from mtrain.converters.smollm2 import smollm2_hf_dir
        model_dir = Path(smollm2_hf_dir())
    else:
        model_dir = Path(args.model)
    hf_config = json.loads((model_dir / "config.json").read_text())
    targets = tuple(args.targets.split(","))
    tensors, config = adapter_tensors(hf_config, args.rank, args.alpha, targets)
    other, _ = adapter_tensors(hf_config, args.rank, args.alpha, targets, seed=1)
    status_dir = tempfile.mkdtemp(prefix="lora-direct-status-")
    os.environ[STATUS_DIR_ENV] = status_dir  # the schedulers inherit it: the direct loader reports errors there
    base = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        base.update({k: v.to(torch.bfloat16).cuda() for k, v in load_file(f).items()})
    engine = sglang.Engine(model_path=str(model_dir), dtype="bfloat16", enable_lora=True, max_lora_rank=args.rank,
                           lora_target_modules=config["target_modules"], max_loras_per_batch=3,
                           custom_weight_loader=[LOAD_LORA_DIRECT],
                           mem_fraction_static=0.5, disable_cuda_graph=True, attention_backend="triton",
                           sampling_backend="pytorch")  # the GPU bundle has no FA3 (sglang_preflight.py)
    try:
        full_bytes = sum(t.numel() * t.element_size() for t in base.values())
        lora_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        full_ms, lora_ms = [], []
        for n in range(args.repeats):
            full_ms.append(timed(lambda: engine.update_weights_from_tensor(list(base.items()))))
            name, previous = f"policy-v{n}", f"policy-v{n - 1}"
            lora_ms.append(timed(lambda: (engine.load_lora_adapter_from_tensors(name, tensors, config),
                                          n and engine.unload_lora_adapter(previous))))
        # direct: one pinned adapter, resident after a request names it, overwritten in place each repeat; the
        # last write is `tensors`, which the fresh load below reads from disk
        res = engine.loop.run_until_complete(engine.tokenizer_manager.load_lora_adapter_from_tensors(
            LoadLoRAAdapterFromTensorsReqInput(lora_name="direct", config_dict=config, pinned=True,
                                               serialized_named_tensors=[MultiprocessingSerializer.serialize(other)]),
            None))
        if not res.success:
            raise SystemExit(f"FAIL: the pinned adapter did not load: {res.error_message}")
        engine.generate(["warm up"], {"temperature": 0.0, "max_new_tokens": 1}, lora_path=["direct"])
        on_gpu = [{k: v.cuda() for k, v in t.items()} for t in (other, tensors)]
        # one untimed write: the loader finds SGLang's LoRA manager once per scheduler process (a scan of the live
        # objects), which no later sync repeats
        engine.update_weights_from_tensor([adapter_marker("direct"), *on_gpu[0].items()],
                                          load_format=LOAD_LORA_DIRECT, flush_cache=True)
        direct_ms = []
        for n in range(args.repeats):
            named = [adapter_marker("direct"), *on_gpu[(args.repeats - 1 - n) % 2 == 0].items()]
            direct_ms.append(timed(lambda: engine.update_weights_from_tensor(named, load_format=LOAD_LORA_DIRECT,
                                                                               flush_cache=True)))
        errors = collect_errors(status_dir)
        if errors:
            raise SystemExit("FAIL: the direct loader reported: " + "; ".join(errors))
        print(f"full sync:    {full_bytes / 2**20:.1f} MiB, {spread(full_ms)}")
        print(f"adapter sync: {lora_bytes / 2**20:.2f} MiB, {spread(lora_ms)}  (load_lora_adapter_from_tensors)")
        print(f"direct sync:  {lora_bytes / 2**20:.2f} MiB, {spread(direct_ms)}  (LoRA pool slot written in place)")
        print(f"ratio: bytes {full_bytes / lora_bytes:.1f}x fewer, time "
              f"{statistics.median(full_ms) / statistics.median(lora_ms):.1f}x shorter (tensors), "
              f"{statistics.median(full_ms) / statistics.median(direct_ms):.1f}x shorter (direct); direct vs tensors "
              f"{statistics.median(lora_ms) / statistics.median(direct_ms):.1f}x shorter")
        live = f"policy-v{args.repeats - 1}"
        with tempfile.TemporaryDirectory() as d:
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{d}/adapter_model.safetensors")
            Path(d, "adapter_config.json").write_text(json.dumps(config))
            engine.load_lora_adapter("fresh", d)
            prompts = ["The capital of France is", "12 + 30 ="]
            sp = {"temperature": 0.0, "max_new_tokens": 16}
            synced = engine.generate(prompts, sp, lora_path=[live] * 2)
            fresh = engine.generate(prompts, sp, lora_path=["fresh"] * 2)
            direct = engine.generate(prompts, sp, lora_path=["direct"] * 2)
            plain = engine.generate(prompts, sp)
        same = [a["text"] == b["text"] for a, b in zip(synced, fresh)]
        same_direct = [a["text"] == b["text"] for a, b in zip(direct, fresh)]
        differs = [a["text"] != b["text"] for a, b in zip(synced, plain)]
        print(f"generation: synced adapter == fresh load: {same}; direct == fresh load: {same_direct}; "
              f"differs from base: {differs}")
        if not all(same):
            raise SystemExit("FAIL: the synced adapter generates differently from a fresh load of the same tensors")
        if not all(same_direct):
            raise SystemExit("FAIL: the directly written adapter generates differently from a fresh load")
        print("OK")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
