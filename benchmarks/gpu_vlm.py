"""Qwen2.5-VL on one GPU: Megatron -> SGLang weight sync checked bit-equal to a fresh load, then GRPO with images.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_vlm.py --out $OUT/vlm       # H200, SGLang
    python benchmarks/gpu_vlm.py --cpu --out /tmp/vlm                                   # CPU: reference engine

1. A tiny random Qwen2.5-VL (mtrain.tiny_vlm with TINY_VLM_GPU_OVERRIDES: head size 64 for SGLang's kernels, text
   and vision) written with its processor files (tokenizer, image processor, chat template), float32 safetensors.
2. Megatron (bf16; float32 with --cpu): VisionLanguageModel built from the config and filled from the files through
   the layout tables (vision tower included).
3. The engine loads the same files itself (SGLang: its own loader, bf16): every parameter's sha256 is the
   reference ("fresh load"). Then for pull and push sync: garble every engine parameter (randomize_weights), sync
   from Megatron through the planner (WeightSync, the trainer's own class), compare every parameter's sha256 with
   the fresh load (language model and `visual.*` alike); sync timed (median of --repeats).
   --cpu: the reference engine (transformers' Qwen2_5_VLForConditionalGeneration), compared tensor by tensor.
4. GRPO with images: `torchrun --nproc-per-node 1 -m mtrain train examples/qwen2_5_vl/tiny_cpu.yaml` on the same
   model (count_shapes task: PIL images of different sizes), --steps steps; per step the engine-vs-trainer logprob
   gap (bf16 on GPU), KL, reward and the step's time split, from the run's metrics.jsonl.
5. (GPU) The release's shape, Qwen2.5-VL-7B (examples/qwen2_5_vl/qwen2_5_vl_7b_config.json, random weights, SGLang
   with dummy weights): pull and push sync times against the copy floor of the same run (--skip-7b skips it).
Writes OUT/gpu_vlm.json (and the run's log and metrics); exit 1 if a parameter differs or the loop fails.
GPU prerequisites beyond the SGLang bundle (docs/design-vlm-data.md): torchvision, Pillow, einops.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "qwen2_5_vl" / "tiny_cpu.yaml"


def missing_modules() -> list[str]:
    return [m for m in ("torchvision", "PIL", "einops") if importlib.util.find_spec(m) is None]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def engine_state(eng, cpu: bool) -> dict:
    """name -> sha256 (SGLang, through our dump_params loader) or -> a tensor copy (reference engine)."""
    if cpu:
        from mtrain.rollout.reference_engine import hf_disk_views
        return {k: v.detach().clone() for k, v in hf_disk_views(eng._model).items()}
    d = tempfile.mkdtemp(prefix="mtrain-vlm-sha-")
    (path,) = eng.dump_params(d)
    with open(path) as f:
        return {k: v["sha256"] for k, v in json.load(f).items()}


def garble(eng, cpu: bool) -> None:
    if not cpu:
        eng.randomize_weights()
        return
    from mtrain.rollout.reference_engine import hf_disk_views
    with torch.no_grad():
        for v in hf_disk_views(eng._model).values():
            v.normal_()


def differs(a, b) -> bool:
    return not torch.equal(a, b) if isinstance(a, torch.Tensor) else a != b


def sync_check(model_dir: Path, cpu: bool, repeats: int) -> dict:
    """Steps 2 and 3: Megatron -> engine, pull and push, bit-equal to the engine's own load of the files."""
    from safetensors.torch import load_file

    from mtrain.layouts import model_layout
    from mtrain.models import build_model
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    from mtrain.rollout.groups import EngineGroups
    from mtrain.trainer.publishers.colocated import WeightSync

    res: dict = {}
    cfg = json.loads((model_dir / "config.json").read_text())
    dtype = torch.float32 if cpu else torch.bfloat16
    chunks, _ = build_model(cfg, params_dtype=dtype)
    layout = model_layout(cfg)
    disk = load_file(str(model_dir / "model.safetensors"))
    load_hf_into_megatron(layout, chunks, lambda n: disk[n], 0)
    res["megatron_params"] = sum(p.numel() for c in chunks for p in c.parameters())
    res["vision_params"] = sum(p.numel() for c in chunks for n, p in c.named_parameters() if n.startswith("vision."))

    t0 = time.perf_counter()
    if cpu:
        from mtrain.rollout.reference_engine import ReferenceEngine
        eng = ReferenceEngine.from_pretrained(str(model_dir))
    else:
        from mtrain.rollout.sglang_engine import SGLangEngine
        eng = SGLangEngine(str(model_dir), tp_size=1, mem_fraction_static=0.3, server_args={"dtype": "bfloat16"})
    res["engine_start_s"] = time.perf_counter() - t0
    fresh = engine_state(eng, cpu)
    res["engine_params"] = len(fresh)
    res["engine_vision_params"] = sum(k.startswith("visual.") for k in fresh)
    version = [0]
    kind = "hf" if cpu else "sglang"
    for mode in ("pull", "push"):
        ws = WeightSync(layout, chunks, eng, groups=EngineGroups(1, 1, 1), engine_kind=kind, dtype=dtype,
                        bucket_bytes=64 << 20, backend="auto", device="cpu" if cpu else "cuda", mode=mode)

        def run():
            version[0] += 1
            ws.sync(version[0])

        garble(eng, cpu)
        res[f"{mode}_garbled_params"] = sum(differs(v, fresh[k]) for k, v in engine_state(eng, cpu).items())
        res[f"{mode}_first_s"] = timed(run, 1)[0]
        after = engine_state(eng, cpu)
        res[f"{mode}_mismatched"] = sorted(k for k in fresh if k not in after or differs(after[k], fresh[k]))
        res[f"{mode}_s_runs"] = timed(run, repeats)
        res[f"{mode}_s"] = statistics.median(res[f"{mode}_s_runs"])
    eng.shutdown()
    del eng, chunks
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def sync_timing_7b(work: Path, repeats: int) -> dict:
    """Step 5: sync time of the release's shape (examples/qwen2_5_vl/qwen2_5_vl_7b_config.json: 7.6 B language model
    + 0.67 B vision tower, bf16), Megatron (random) -> SGLang (dummy weights), pull and push, against the copy floor
    measured in the same run (every weight read and written once). Bit-equality is the tiny model's check above."""
    from mtrain.layouts import model_layout
    from mtrain.models import build_model
    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.sglang_engine import SGLangEngine
    from mtrain.tiny_vlm import write_tiny_vlm_processor
    from mtrain.trainer.publishers.colocated import WeightSync

    cfg = json.loads((CONFIG.parent / "qwen2_5_vl_7b_config.json").read_text())
    d = work / "qwen2_5_vl_7b"
    write_tiny_vlm_processor(d)  # SGLang builds the model's processor at start, even with skip_tokenizer_init
    (d / "config.json").write_text(json.dumps(cfg))
    chunks, _ = build_model(cfg, params_dtype=torch.bfloat16)
    n = sum(p.numel() for c in chunks for p in c.parameters())
    res: dict = {"params": n, "vision_params": sum(p.numel() for c in chunks for k, p in c.named_parameters()
                                                   if k.startswith("vision."))}
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    bw = 2 * a.numel() * 2 / statistics.median(timed(lambda: b.copy_(a), 10))
    del a, b
    res["copy_GBps"] = bw / 1e9
    res["floor_s"] = 2 * n * 2 / bw
    t0 = time.perf_counter()
    eng = SGLangEngine(str(d), tp_size=1, mem_fraction_static=0.35, load_format="dummy",
                       server_args={"dtype": "bfloat16"})
    res["engine_start_s"] = time.perf_counter() - t0
    layout = model_layout(cfg)
    version = [0]
    for mode in ("pull", "push"):
        ws = WeightSync(layout, chunks, eng, groups=EngineGroups(1, 1, 1), engine_kind="sglang", dtype=torch.bfloat16,
                        bucket_bytes=512 << 20, backend="auto", device="cuda", mode=mode)

        def run():
            version[0] += 1
            ws.sync(version[0])

        res[f"{mode}_first_s"] = timed(run, 1)[0]
        res[f"{mode}_s_runs"] = timed(run, repeats)
        res[f"{mode}_s"] = statistics.median(res[f"{mode}_s_runs"])
        res[f"{mode}_over_floor"] = res[f"{mode}_s"] / res["floor_s"]
    eng.shutdown()
    del eng, chunks
    torch.cuda.empty_cache()
    return res


def grpo(model_dir: Path, work: Path, out: Path, cpu: bool, steps: int) -> dict:
    """Step 4: the user's command; per-step metrics from the run."""
    run_dir = work / "run"
    over = {"model.hf_path": model_dir, "train.run_dir": run_dir, "train.steps": steps,
            "model.dtype": "float32" if cpu else "bfloat16", "engine.kind": "reference" if cpu else "sglang"}
    if not cpu:
        over.update({"engine.mem_fraction_static": 0.25, "rollout.prompts_per_step": 8,
                     "rollout.samples_per_prompt": 8, "rollout.max_new_tokens": 32, "train.micro_batch_size": 16})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "mtrain",
           "train", str(CONFIG), *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCHDYNAMO_DISABLE="1")
    t0 = time.perf_counter()
    # From outside the checkout: `python -m` puts the working directory first on sys.path (gpu_setup.sh's copy
    # of mtrain, with its mtrain.kernels mapping, must win).
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    res: dict = {"command": " ".join(str(c) for c in cmd), "exit": p.returncode,
                 "wall_s": time.perf_counter() - t0}
    (out / "grpo_log.txt").write_text(p.stdout + "\n" + p.stderr)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    if metrics.exists():
        (out / "grpo_metrics.jsonl").write_text(metrics.read_text())
    keep = ("step", "kl/mean", "reward/mean", "grad_norm", "ppo/clipfrac")
    res["steps"] = [{k: v for k, v in r.items() if k in keep or k.startswith(("logprob_diff/", "time/"))}
                    for r in records if "step" in r]
    if p.returncode != 0:
        res["error_tail"] = p.stderr[-4000:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mtrain-vlm"))
    ap.add_argument("--cpu", action="store_true", help="reference engine, float32 (what CI can run)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-7b", action="store_true", help="GPU: skip the Qwen2.5-VL-7B-shaped sync timing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = not args.cpu
    if gpu and (missing := missing_modules()):
        print(f"gpu_vlm: SGLang's Qwen2.5-VL needs {', '.join(missing)} (not in the SGLang bundle): install them "
              f"first", file=sys.stderr)
        return 2
    if gpu and not torch.cuda.is_available():
        print("gpu_vlm: no CUDA device (use --cpu for the reference-engine run)", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")

    from mtrain.tiny_vlm import TINY_VLM_GPU_OVERRIDES, write_tiny_vlm
    work = Path(tempfile.mkdtemp(prefix="mtrain-gpu-vlm-"))
    model_dir = write_tiny_vlm(work / "tiny-vlm", seed=0, overrides=TINY_VLM_GPU_OVERRIDES)
    res: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "engine": "sglang" if gpu else "reference",
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    from mtrain.dist import init_distributed
    init_distributed()
    res["sync"] = sync_check(model_dir, args.cpu, args.repeats)
    if gpu and not args.skip_7b:
        try:
            res["sync_7b"] = sync_timing_7b(work, args.repeats)
        except Exception as e:  # noqa: BLE001 - recorded; the checks above and the GRPO run still count
            res["sync_7b"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "gpu_vlm.json").write_text(json.dumps(res, indent=1, default=str))  # kept if the GRPO run hangs
    res["grpo"] = grpo(model_dir, work, out, args.cpu, args.steps)
    (out / "gpu_vlm.json").write_text(json.dumps(res, indent=1, default=str))

    s, g = res["sync"], res["grpo"]
    ok = not s["pull_mismatched"] and not s["push_mismatched"] and g["exit"] == 0 and len(g["steps"]) == args.steps
    print(f"\nQwen2.5-VL tiny on {res['device']} ({res['engine']}): {s['engine_params']} engine params "
          f"({s['engine_vision_params']} visual.*), Megatron {s['megatron_params']:,} ({s['vision_params']:,} vision)")
    for mode in ("pull", "push"):
        print(f"{mode}: bit-equal to the fresh load: {not s[f'{mode}_mismatched']} ({s[f'{mode}_garbled_params']} "
              f"params garbled before); sync {s[f'{mode}_s'] * 1e3:.2f} ms (first {s[f'{mode}_first_s'] * 1e3:.1f} ms)")
    if "sync_7b" in res:
        t = res["sync_7b"]
        print("7B-shaped sync: " + (t["error"] if "error" in t else
              f"{t['params'] / 1e9:.2f} B params; pull {t['pull_s'] * 1e3:.1f} ms ({t['pull_over_floor']:.2f}x the "
              f"copy floor {t['floor_s'] * 1e3:.1f} ms), push {t['push_s'] * 1e3:.1f} ms ({t['push_over_floor']:.2f}x)"))
    for r in g["steps"]:
        print(f"step {r['step']}: logprob gap mean {r.get('logprob_diff/mean_abs', float('nan')):.2e} max "
              f"{r.get('logprob_diff/max_abs', float('nan')):.2e} kl {r.get('kl/mean', 0):.2e} "
              + " ".join(f"{k[5:]}={v:.2f}s" for k, v in sorted(r.items()) if k.startswith("time/")))
    if g["exit"] != 0:
        print(f"GRPO run failed (exit {g['exit']}); log in {out / 'grpo_log.txt'}:\n{g.get('error_tail', '')}")
    print(f"wrote {out / 'gpu_vlm.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
