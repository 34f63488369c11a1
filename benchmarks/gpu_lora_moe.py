"""Expert LoRA on SGLang 0.5.17 (Qwen3-MoE shape), through mtrain's engine protocol (GPU).

    python benchmarks/gpu_lora_moe.py [--arch qwen3_moe] [--targets qkv,o_proj,experts] [--rank 8]

Writes a tiny random model (`mtrain init-tiny --arch qwen3_moe`'s writer), starts mtrain's SGLangEngine with
SGLang's LoRA enabled for the adapter table's PEFT names (what the trainer does, mtrain/trainer/engines.py:
sglang_lora_args), then drives the trainer's sync protocol: switch_adapter to policy-v0, then policy-v1 (v0
unloaded), tensors by the adapter table's HF names (per-expert `mlp.experts.{e}.gate_proj.lora_A.weight` ...).
Checks, greedy, on token ids: generation under the synced v1 equals generation under the same tensors loaded fresh
from a PEFT directory, and differs from the base model's and from v0's (the expert adapters are applied).

Why this should run (read from SGLang 0.5.17's source): lora_manager.init_lora_modules wraps every FusedMoE in
FusedMoEWithLoRA when gate_up_proj and down_proj are targets; mem_pool allocates 4D `gate_up_proj_moe` /
`down_proj_moe` buffers [slots, experts, r, ...] and loads PEFT per-expert names (`experts.(\\d+).`) into them;
lora.py stacks each expert's gate/up like the dense gate_up_proj. Prints one line per check and OK, or FAIL and why.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--targets", default="qkv,o_proj,experts")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    args = ap.parse_args()
    from safetensors.torch import save_file

    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout
    from mtrain.rollout.lora_adapters import adapter_name, peft_config, switch_adapter
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.sglang_engine import SGLangEngine
    from mtrain.tiny_hf import write_tiny_hf
    from mtrain.trainer.publishers.lora import engine_lora_args

    work = Path(tempfile.mkdtemp(prefix="lora-moe-"))
    # head size 64: SGLang 0.5.17 has fused RoPE kernels for 64/128/256/512 only; mtrain's engine preflight refuses
    # the tiny configs' 16 (its fallback crashed the schedulers on the H200)
    hf = write_tiny_hf(args.arch, work / args.arch, seed=0, overrides={"head_dim": 64})
    cfg = json.loads((hf / "config.json").read_text())
    base = model_layout(dict(cfg, num_nextn_predict_layers=0), mtp=False)
    spec = LoraSpec(args.rank, args.alpha, tuple(args.targets.split(",")))
    table = lora_layout(base, spec)
    lora = engine_lora_args(base, spec)
    experts = sum(".experts." in w.hf[0].name for w in table.weights)
    print(f"model {args.arch}: {cfg.get('num_experts', cfg.get('num_local_experts'))} experts x {cfg['num_hidden_layers']} layers; adapter rows "
          f"{len(table.weights)} ({experts} on experts); PEFT target_modules {lora['target_modules']}")

    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        return {w.hf[0].name: (0.05 * torch.randn(w.shape, generator=g)).to(torch.bfloat16).cuda()
                for w in table.weights}

    engine = SGLangEngine(str(hf), mem_fraction_static=0.3, server_args={
        "dtype": "bfloat16", "enable_lora": True, "max_lora_rank": args.rank,
        "lora_target_modules": lora["target_modules"], "max_loras_per_batch": 3, "disable_cuda_graph": True,
        "attention_backend": "triton", "sampling_backend": "pytorch"})
    try:
        prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 12, 60, 3]]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12)

        def run(tag):
            return [c.output_ids for c in engine.generate(
                [Request(rid=f"{tag}{i}", prompt_ids=p, params=greedy) for i, p in enumerate(prompts)])]

        plain = run("base")
        v0, v1 = tensors(0), tensors(1)
        switch_adapter(engine, 0, v0, lora)
        out0 = run("v0")
        switch_adapter(engine, 1, v1, lora)
        out1 = run("v1")
        print("adapters after two syncs: v1 active, v0 unloaded:", engine.adapters.active)
        d = work / "fresh"
        d.mkdir()
        save_file({f"base_model.model.{k}": v.cpu().contiguous() for k, v in v1.items()},
                  str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(peft_config(lora)))
        fresh_name = adapter_name(1000)  # a policy-v name: the engine reads each request's version from it
        ok = engine._run(engine._engine.tokenizer_manager.load_lora_adapter(
            engine._io.LoadLoRAAdapterReqInput(lora_name=fresh_name, lora_path=str(d)), None), "load fresh")
        if not getattr(ok, "success", False):
            raise SystemExit(f"FAIL: SGLang could not load the PEFT directory: {getattr(ok, 'error_message', ok)}")
        engine.adapters.activate(fresh_name)
        fresh = run("fresh")
        checks = {"synced v1 == fresh load of v1": out1 == fresh, "v1 differs from base": out1 != plain,
                  "v1 differs from v0": out1 != out0}
        for k, v in checks.items():
            print(f"{k}: {v}")
        if not all(checks.values()):
            raise SystemExit("FAIL: " + ", ".join(k for k, v in checks.items() if not v))
        print("OK")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
