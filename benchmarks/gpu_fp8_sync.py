"""FP8 rollout from bf16 training on one GPU: bf16 Megatron weights -> SGLang's block-FP8 parameters through the
resharding kernel (quantization fused into the scatter), pull and push; checked bit for bit, diagnosed, timed.

    source benchmarks/gpu_setup.sh
    python benchmarks/gpu_fp8_sync.py --out $OUT/fp8 --model dsv3tiny --disk
    python benchmarks/gpu_fp8_sync.py --out $OUT/fp8 --model llama8b --contiguous-params

1. A Megatron-core GPTModel (bf16, random init) on the GPU: the trainer.
2. Quantization checks on the GPU, for the --diag-layers' linear weights: `quantize_blocks` (torch, CUDA) and
   the old formula (`amax / 448.0`, a Python-scalar divisor: CUDA torch multiplies by float32(1/448)) against
   an independent float64 quantization (`mtrain.rollout.fp8_diagnose.quantize_f64`, on the CPU).
3. The FP8 checkpoint of the same weights: Megatron -> HF tensors (our planner), every linear weight quantized on
   its own with `quantize_blocks`, stored as `weight` + `weight_scale_inv` like DeepSeek's release. With --disk
   it is written as safetensors + an FP8 config.json and the FP8 engine loads it at start (SGLang's full load:
   loader, then process_weights_after_loading); otherwise the engine starts with dummy weights and SGLang's
   loader is fed the tensors by HF names. Reference: every engine parameter's sha256, and the --diag-layers'
   parameters as tensors (our dump_params loader, dtype- and stride-exact).
4. The FP8 engine (quantization fp8, triton FP8 GEMMs): pull and push sync through the trainer's WeightSync,
   timed (--repeats runs each, every run kept); then per mode: garble (x -2: FP8 values flip sign, scales
   double), sync, restore (x -0.5, exact in bf16), sync, compare every parameter's sha256 with the reference;
   for the --diag-layers' parameters also: SGLang's load and our sync each against the float64 quantization of
   the bf16 source (the SGLang-layout tensor our planner makes), and on any difference its kind
   (`fp8_diagnose.diagnose_pair`: layout / UE8M0 / fnuz / scale ulp (IEEE vs reciprocal) / values), plus the
   old formula's checkpoint vs our sync (what the 2026-11-30 run compared). Generate greedily (tokens/s).
5. The same model in a bf16 engine: pull sync timed (the baseline of the same run), the same prompts: tokens/s,
   greedy first-token agreement and logprob gap FP8 vs bf16.
Copy floors from the copy bandwidth measured in this run. Prints a summary; writes <out>/gpu_fp8_sync_<model>.json
(--out, else $OUT, else only printed); exit 1 if any parameter differs from the reference for a reason `explain`
does not name (SGLang's Llama loader dropping block scales; our KV-scale reset).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import CONFIGS, contiguous_params, copy_bandwidth, timed  # noqa: E402


def fp8_checkpoint(hf: dict[str, torch.Tensor], layout) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the FP8 checkpoint: linear weights as fp8 + weight_scale_inv, the rest as they are."""
    from mtrain.kernels import quantize_blocks
    from mtrain.layouts.fp8 import BLOCK, SCALE_SUFFIX

    linear = {p.name for w in layout.weights if w.block_fp8 and w.sglang for p in w.hf}
    out = []
    for name, t in hf.items():
        if name in linear:
            q, s = quantize_blocks(t, BLOCK)
            out += [(name, q), (name + SCALE_SUFFIX, s)]
        else:
            out.append((name, t))
    return out


def quantize_scalar_div(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint quantization of the 2026-11-30 run (quantize_blocks before the fix): `amax / 448.0`."""
    bn, bk = block
    x = w.detach().to(torch.float32)
    lead, (n, k) = x.shape[:-2], x.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=x.device)
    pad[..., :n, :k] = x
    blocks = pad.view(*lead, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(-3, -1), keepdim=True) / 448.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, blocks / safe, blocks * 0.0).clamp(-448.0, 448.0)
    q = q.view(*lead, nb * bn, kb * bk)[..., :n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.view(*lead, nb, kb).contiguous()


def in_layers(name: str, layers: set[int]) -> bool:
    parts = name.split(".")
    return "layers" in parts and int(parts[parts.index("layers") + 1]) in layers


def sampled(d: dict, rows: int, experts: int = 2) -> dict:
    """The first `rows` rows (whole 128-blocks) of every tensor, and of 3-D ones the first `experts` slots: the
    float64 diagnosis runs on the CPU, this bounds its cost (0: whole tensors). Scales are cut in block units."""
    from mtrain.layouts.fp8 import BLOCK, SCALE_SUFFIX

    if rows <= 0:
        return d
    out = {}
    for n, t in d.items():
        r = rows // BLOCK[0] if n.endswith(SCALE_SUFFIX) else rows
        t = t[:experts] if t.dim() == 3 else t
        out[n] = t[..., :r, :].contiguous() if t.dim() >= 2 else t
    return out


def hf_sample_names(names, layers: set[int]) -> list[str]:
    """HF names in the diag layers, routed experts 0 and 1 only."""
    out = []
    for n in sorted(names):
        parts = n.split(".")
        if not in_layers(n, layers):
            continue
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit() and \
                int(parts[parts.index("experts") + 1]) >= 2:
            continue
        out.append(n)
    return out


def dump(eng, tag: str, names=None, what: str = "sha256"):
    d = tempfile.mkdtemp(prefix=f"mtrain-fp8-{tag}-")
    (path,) = eng.dump_params(d, names=names, what=what)
    if what == "sha256":
        with open(path) as f:
            return json.load(f)
    return torch.load(path, map_location="cpu")


def sha256(t: torch.Tensor) -> str:
    from mtrain.rollout.sglang_loader import tensor_sha256  # as the engine's dump hashes a parameter
    return tensor_sha256(t.detach().cpu())


ONE_F32 = sha256(torch.tensor(1.0, dtype=torch.float32))


def expected_scales(sg: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of the block scale `quantize_blocks` gives each SGLang-layout weight (engine TP 1): what a sync must
    leave in `<weight>_scale_inv` (quantize_blocks == float64 is checked on the GPU by quant_checks)."""
    from mtrain.kernels import quantize_blocks
    from mtrain.layouts.fp8 import SCALE_SUFFIX
    return {n + SCALE_SUFFIX: sha256(quantize_blocks(t)[1]) for n, t in sg.items()
            if n.endswith("weight") and t.dim() >= 2}  # `.weight`, and FusedMoE's `w13_weight` / `w2_weight`


def explain(mismatched: list[str], reference: dict, after: dict, scales: dict[str, str]) -> dict[str, str]:
    """Why each parameter differs from the reference engine's, where a known SGLang behaviour explains it:
    - `sglang_loader_dropped_scale`: SGLang's Llama loader renames `weight_scale_inv` to `weight_scale`
      (models/llama.py:679-680; the v2 loader likewise, model_loader/auto_loader.py:216-223), which block-FP8
      layers do not have, so a load of a block-FP8 Llama checkpoint -- from disk or by HF names -- leaves every
      block scale as it was (dummy values here). Ours then equals the quantization of the source, SGLang's not.
    - `kv_scale_reset`: an attention layer's k/v scale set to 1.0 by our sync (sglang_loader.reset_kv_scales),
      where the reference holds the value SGLang derived from the dummy weights it started with.
    Anything else is `unexplained`."""
    out = {}
    for n in mismatched:
        got, ref = after.get(n, {}).get("sha256"), reference[n]["sha256"]
        if n in scales and got == scales[n] and ref != scales[n]:
            out[n] = "sglang_loader_dropped_scale"
        elif n.endswith(("attn.k_scale", "attn.v_scale", "attn_mqa.k_scale", "attn_mqa.v_scale",
                         "attn_mha.k_scale", "attn_mha.v_scale")) and got == ONE_F32:
            out[n] = "kv_scale_reset"
        else:
            out[n] = "unexplained"
    return out


def scale_params(chunks, factor: float) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.mul_(factor)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(n)]


def generate(eng, batch: list[list[int]], new_tokens: int):
    from mtrain.rollout.protocol import Request, SamplingParams

    reqs = [Request(rid=f"r{i}", prompt_ids=p, params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
            for i, p in enumerate(batch)]
    eng.generate(reqs[:2])  # warm-up (Triton JIT of the attention/MoE/FP8 kernels)
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    dt = time.perf_counter() - t0
    return out, sum(len(c.output_ids) for c in out) / dt


def spread(runs: list[float]) -> dict:
    return {"median_ms": statistics.median(runs) * 1e3, "min_ms": min(runs) * 1e3, "max_ms": max(runs) * 1e3,
            "mean_ms": statistics.mean(runs) * 1e3,
            "stdev_ms": (statistics.stdev(runs) if len(runs) > 1 else 0.0) * 1e3, "runs": len(runs)}


def guarded(fn, *args, **kwargs):
    """A diagnosis step that fails is reported in the JSON, never the end of the GPU run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def sglang_fp8_settings() -> dict:
    """What decides SGLang's post-load processing of block-FP8 layers on this machine (docs/fp8.md, "After load")."""
    import importlib.util

    out: dict = {"deep_gemm_importable": importlib.util.find_spec("deep_gemm") is not None,
                 "SGLANG_ENABLE_JIT_DEEPGEMM": os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM"),
                 "capability": list(torch.cuda.get_device_capability())}
    try:
        from sglang.srt.layers import deep_gemm_wrapper

        out.update(ENABLE_JIT_DEEPGEMM=bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM),
                   DEEPGEMM_SCALE_UE8M0=bool(deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0))
    except Exception as e:  # noqa: BLE001 -- a report, never a reason to stop the run
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def quant_checks(hf: dict, layout, layers: set[int], rows: int) -> dict:
    """GPU quantize_blocks and the old scalar-division formula vs the float64 reference, per diag tensor."""
    from mtrain.kernels import quantize_blocks
    from mtrain.rollout.fp8_diagnose import quantize_f64, same_bits, ulp_distance

    linear = {p.name for w in layout.weights if w.block_fp8 and w.sglang for p in w.hf}
    res = {"tensors": 0, "gpu_quantize_blocks_equal_f64": 0, "old_formula_equal_f64": 0,
           "old_formula_scales_differ": 0, "scales": 0, "old_formula_max_ulps": 0, "gpu_mismatches": []}
    for name in (n for n in hf_sample_names(hf, layers) if n in linear):
        t = hf[name][:rows] if rows > 0 else hf[name]
        q64, s64 = quantize_f64(t.cpu())
        q, s = quantize_blocks(t)
        qo, so = quantize_scalar_div(t)
        res["tensors"] += 1
        ok = same_bits(q.cpu(), q64) and same_bits(s.cpu(), s64)
        res["gpu_quantize_blocks_equal_f64"] += ok
        if not ok:
            res["gpu_mismatches"].append(name)
        res["old_formula_equal_f64"] += same_bits(qo.cpu(), q64) and same_bits(so.cpu(), s64)
        res["old_formula_scales_differ"] += int((so.cpu() != s64).sum())
        res["scales"] += s64.numel()
        res["old_formula_max_ulps"] = max(res["old_formula_max_ulps"], int(ulp_distance(so.cpu(), s64).max()))
    return res


def diagnose_state(ref: dict, got: dict, src: dict, fp8_names: set[str]) -> dict:
    """Per diag parameter: SGLang's load (ref) and ours (got) vs float64(src), and ref vs got's kind."""
    from mtrain.layouts.fp8 import SCALE_SUFFIX
    from mtrain.rollout.fp8_diagnose import diagnose_pair, diagnose_plain, quantize_f64, same_bits

    out = {}
    for name in sorted(ref):
        if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in fp8_names:
            continue
        if name not in got:
            out[name] = {"kind": "missing after sync"}
            continue
        if name in fp8_names and name in src:
            q64, s64 = quantize_f64(src[name])
            sname = name + SCALE_SUFFIX
            r = diagnose_pair(name, ref, got, src[name])
            r["sglang_load_equals_f64"] = same_bits(ref[name], q64) and same_bits(ref[sname], s64)
            r["ours_equals_f64"] = same_bits(got[name], q64) and same_bits(got[sname], s64)
            out[name] = r
        else:
            out[name] = diagnose_plain(ref[name], got[name])
    return out


def save(res: dict, out_dir: str | None, model: str, final: bool = False) -> None:
    """The JSON so far (rewritten after each stage: a crash later keeps what was measured)."""
    if out_dir:
        path = os.path.join(out_dir, f"gpu_fp8_sync_{model}.json")
        with open(path, "w") as f:
            json.dump(dict(res, complete=final), f, indent=1)
        if final:
            print(f"wrote {path}")


def report_mode(res: dict, mode: str, layers: set[int], n_fp8_diag: int) -> None:
    """Print one sync mode's equality and diagnosis (right after it runs: a later crash keeps it in the log)."""
    print(f"FP8 {mode}: bit-equal to SGLang's load of the FP8 checkpoint: {not res[f'fp8_{mode}_mismatched']} "
          f"({len(res[f'fp8_{mode}_mismatched'])} of {res['params_checked']} params differ; "
          f"{res[f'fp8_{mode}_params_changed_by_garble']} changed by the garble)")
    print(f"  diag ({res['diag_params']} params of layers {sorted(layers)}): kinds "
          f"{res[f'fp8_{mode}_diagnosis_kinds']}; == float64: SGLang's load "
          f"{res[f'fp8_{mode}_sglang_load_equals_f64']}/{n_fp8_diag}, ours {res[f'fp8_{mode}_ours_equals_f64']}"
          f"/{n_fp8_diag} FP8 weights; vs the old (2026-11-30) reference: {res[f'fp8_{mode}_vs_old_reference_kinds']}")
    diag = res[f"fp8_{mode}_diagnosis"]
    bad = [(n, d) for n, d in diag.items() if isinstance(d, dict) and d.get("kind") != "equal"][:8]
    for n, d in bad:
        print(f"    {n}: {d['kind']} (SGLang load == float64: {d.get('sglang_load_equals_f64')}, ours == "
              f"float64: {d.get('ours_equals_f64')})")
    outside = [k for k in res[f"fp8_{mode}_mismatched"] if k not in diag]
    if outside:
        print(f"    {len(outside)} differing params outside the diag layers, e.g. {outside[:3]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dsv3tiny")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON (default $OUT)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="push-mode bucket size")
    ap.add_argument("--repeats", type=int, default=10, help="timed syncs per mode (all kept: the spread)")
    ap.add_argument("--disk", action="store_true", help="reference = SGLang loading the FP8 checkpoint from disk")
    ap.add_argument("--contiguous-params", action="store_true", help="Megatron params in one buffer per dtype")
    ap.add_argument("--diag-layers", default="0,1,-1", help="layers whose parameters are dumped and diagnosed")
    ap.add_argument("--diag-rows", type=int, default=256,
                    help="diagnose the first N rows of each diag tensor (whole 128-row blocks; 0 = all rows)")
    ap.add_argument("--gen", type=int, default=64, help="prompts per generate batch")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.diag_rows < 0 or args.diag_rows % 128:
        ap.error(f"--diag-rows must be a non-negative multiple of 128 (whole blocks), got {args.diag_rows}")

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models.builder import build_model
    from mtrain.reshard.local import reshard_in_memory
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import HFLayout, MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.rollout.fp8_diagnose import diagnose_pair
    from mtrain.rollout.fp8_engine import SERVER_ARGS, fp8_config
    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.sglang_engine import SGLangEngine
    from mtrain.trainer.publishers.colocated import WeightSync

    cfg = CONFIGS[args.model]
    n_layers = int(cfg["num_hidden_layers"])
    layers = {int(x) % n_layers for x in args.diag_layers.split(",") if x.strip()}
    res: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "args": vars(args),
                 "diag_layers": sorted(layers)}
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    init_distributed()
    chunks, _ = build_model(cfg, params_dtype=torch.bfloat16)
    if args.contiguous_params:
        contiguous_params(chunks)
    layout = model_layout(cfg)
    lookup = tensor_lookup(chunks)
    hf = {k[2]: v for k, v in reshard_in_memory(build_plan(layout, MegatronLayout(), HFLayout()), lookup,
                                                dtype=torch.bfloat16, backend="triton", device="cuda").items()}
    res["sglang_fp8_settings"] = sglang_fp8_settings()
    res["quantization_gpu_vs_f64"] = guarded(quant_checks, hf, layout, layers, args.diag_rows)
    ckpt = fp8_checkpoint(hf, layout)
    n_bf16 = sum(t.numel() * 2 for t in hf.values())
    n_fp8 = sum(t.numel() * t.element_size() for _, t in ckpt)
    quantized = sum(t.numel() for n, t in ckpt if t.dtype == torch.float8_e4m3fn)
    del hf
    # The bf16 source of every diag parameter in SGLang's own layout (engine TP 1): what the FP8 ones quantize.
    sg = reshard_in_memory(build_plan(layout, MegatronLayout(), SGLangLayout(tp=1)), lookup, dtype=torch.bfloat16,
                           backend="triton", device="cuda")
    src = sampled({k[2]: v.cpu() for k, v in sg.items() if in_layers(k[2], layers)}, args.diag_rows)
    scales = expected_scales({k[2]: v for k, v in sg.items()})
    del sg
    torch.cuda.empty_cache()
    bw = copy_bandwidth()
    res.update(copy_GBps=bw / 1e9, bf16_bytes=n_bf16, fp8_engine_bytes=n_fp8, fp8_params=quantized,
               bf16_floor_s=2 * n_bf16 / bw, fp8_floor_s=(n_bf16 + n_fp8) / bw)

    work = tempfile.mkdtemp(prefix="mtrain-fp8-sync-")
    fp8_dir, bf16_dir = os.path.join(work, "fp8"), os.path.join(work, "bf16")
    for d, c in ((fp8_dir, fp8_config(dict(cfg, torch_dtype="bfloat16"))), (bf16_dir, dict(cfg, torch_dtype="bfloat16"))):
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
    if args.disk:
        from mtrain.converters.safetensors_io import ShardedWriter
        with ShardedWriter(fp8_dir + ".st", max_shard_bytes=4 << 30) as w:
            for n, t in ckpt:
                w.add(n, t.cpu())
            w.commit()
        for fn in os.listdir(fp8_dir + ".st"):
            os.replace(os.path.join(fp8_dir + ".st", fn), os.path.join(fp8_dir, fn))

    # ---- FP8 engine
    t0 = time.perf_counter()
    eng = SGLangEngine(fp8_dir, tp_size=1, mem_fraction_static=0.35, load_format="auto" if args.disk else "dummy",
                       server_args={"dtype": "bfloat16", **SERVER_ARGS})
    res["fp8_engine_start_s"] = time.perf_counter() - t0
    if not args.disk:
        eng.update_weights_hf_names(ckpt)  # SGLang's own loader
    del ckpt
    torch.cuda.empty_cache()
    reference = dump(eng, "ref")
    fp8_names = {n for n, v in reference.items() if v["dtype"] == "float8_e4m3fn"}
    diag_names = sorted(n for n in reference if in_layers(n, layers))
    ref_t = sampled(dump(eng, "ref-t", diag_names, "tensors"), args.diag_rows)
    res["params_checked"] = len(reference)
    res["fp8_params_in_engine"] = len(fp8_names)
    res["diag_params"] = len(diag_names)
    # What the 2026-11-30 run's reference held: the old formula's quantization of the same sources.
    old = {}
    for n in diag_names:
        if n in fp8_names and n in src:
            q, s = quantize_scalar_div(src[n].cuda())
            old[n], old[n + "_scale_inv"] = q.cpu(), s.cpu()

    def weight_sync(mode: str, fp8: bool, engine):
        return WeightSync(layout, chunks, engine, groups=EngineGroups(1, 1, 1), engine_kind="sglang",
                          dtype=torch.bfloat16, bucket_bytes=args.bucket_mb << 20, backend="triton", device="cuda",
                          mode=mode, engine_fp8=fp8)

    version = [0]

    def run(ws):
        version[0] += 1
        ws.sync(version[0])

    syncs = {m: weight_sync(m, True, eng) for m in ("pull", "push")}
    for mode, ws in syncs.items():
        res[f"fp8_{mode}_first_s"] = timed(lambda: run(ws), 1)[0]
        res[f"fp8_{mode}_s_runs"] = timed(lambda: run(ws), args.repeats)  # every run kept: the spread is reported
        res[f"fp8_{mode}_s"] = statistics.median(res[f"fp8_{mode}_s_runs"])
        scale_params(chunks, -2.0)
        run(ws)
        res[f"fp8_{mode}_params_changed_by_garble"] = sum(
            v["sha256"] != reference[k]["sha256"] for k, v in dump(eng, "garbled").items())
        scale_params(chunks, -0.5)
        run(ws)
        after = dump(eng, mode)
        res[f"fp8_{mode}_mismatched"] = sorted(k for k in reference if after.get(k, {}).get("sha256")
                                               != reference[k]["sha256"])
        why = explain(res[f"fp8_{mode}_mismatched"], reference, after, scales)
        res[f"fp8_{mode}_mismatch_kinds"] = dict(Counter(why.values()))
        res[f"fp8_{mode}_unexplained"] = sorted(n for n, k in why.items() if k == "unexplained")
        got_t = sampled(dump(eng, f"{mode}-t", diag_names, "tensors"), args.diag_rows)
        diag = guarded(diagnose_state, ref_t, got_t, src, fp8_names)
        res[f"fp8_{mode}_diagnosis"] = diag
        ok_diag = "error" not in diag
        res[f"fp8_{mode}_diagnosis_kinds"] = dict(Counter(d["kind"] for d in diag.values())) if ok_diag else diag
        res[f"fp8_{mode}_sglang_load_equals_f64"] = sum(bool(d.get("sglang_load_equals_f64")) for d in diag.values()
                                                        ) if ok_diag else None
        res[f"fp8_{mode}_ours_equals_f64"] = sum(bool(d.get("ours_equals_f64")) for d in diag.values()
                                                 ) if ok_diag else None
        res[f"fp8_{mode}_vs_old_reference_kinds"] = guarded(lambda: dict(Counter(
            diagnose_pair(n, old, got_t, src[n])["kind"] for n in diag_names if n in old and n in src)))  # weights only
        report_mode(res, mode, layers, sum(1 for n in diag_names if n in fp8_names and n in src))
        save(res, out_dir, args.model)
    batch = prompts(args.gen, cfg["vocab_size"])
    fp8_out, res["fp8_tokens_per_s"] = generate(eng, batch, args.new_tokens)
    res["fp8_generated_tokens"] = sum(len(c.output_ids) for c in fp8_out)
    eng.shutdown()
    del eng, syncs
    torch.cuda.empty_cache()

    # ---- bf16 engine, same run: the baseline
    t0 = time.perf_counter()
    eng = SGLangEngine(bf16_dir, tp_size=1, mem_fraction_static=0.35, load_format="dummy",
                       server_args={"dtype": "bfloat16"})
    res["bf16_engine_start_s"] = time.perf_counter() - t0
    pull = weight_sync("pull", False, eng)
    res["bf16_pull_first_s"] = timed(lambda: run(pull), 1)[0]
    res["bf16_pull_s_runs"] = timed(lambda: run(pull), args.repeats)
    res["bf16_pull_s"] = statistics.median(res["bf16_pull_s_runs"])
    bf16_out, res["bf16_tokens_per_s"] = generate(eng, batch, args.new_tokens)
    eng.shutdown()
    same = [(a, b) for a, b in zip(fp8_out, bf16_out) if a.output_ids and b.output_ids
            and a.output_ids[0] == b.output_ids[0]]
    res["first_token_agreement"] = len(same) / max(1, len(batch))
    res["first_token_logprob_gap_mean"] = (statistics.mean(abs(a.logprobs[0] - b.logprobs[0]) for a, b in same)
                                           if same else None)
    for key in ("fp8_pull", "fp8_push", "bf16_pull"):
        res[f"{key}_spread"] = spread(res[f"{key}_s_runs"])
    fp8r, bfr = res["fp8_pull_s_runs"], res["bf16_pull_s_runs"]
    res["fp8_over_bf16_pull"] = {"median": statistics.median(fp8r) / statistics.median(bfr),
                                 "best": min(fp8r) / min(bfr), "worst": max(fp8r) / max(bfr)}

    ok = not (res["fp8_pull_unexplained"] or res["fp8_push_unexplained"])
    print(f"\n{args.model}: {quantized / 1e9:.2f} G FP8 weights, {res['fp8_params_in_engine']} FP8 params of "
          f"{res['params_checked']}; copy {bw / 1e9:.0f} GB/s")
    print(f"SGLang FP8 post-load settings: {res['sglang_fp8_settings']}")
    q = res["quantization_gpu_vs_f64"]
    if "error" in q:
        print(f"GPU quantization vs float64: {q['error']}")
    else:
        print(f"GPU quantization vs float64 ({q['tensors']} tensors of layers {sorted(layers)}): quantize_blocks "
              f"equal {q['gpu_quantize_blocks_equal_f64']}/{q['tensors']}; old `amax / 448.0` equal "
              f"{q['old_formula_equal_f64']}/{q['tensors']}, its scales differ in {q['old_formula_scales_differ']}"
              f" of {q['scales']} blocks (max {q['old_formula_max_ulps']} ulp)")
    for key in ("fp8_pull", "fp8_push", "bf16_pull"):
        s = res[f"{key}_spread"]
        print(f"{key} ms over {s['runs']} runs: median {s['median_ms']:.2f}, min {s['min_ms']:.2f}, max "
              f"{s['max_ms']:.2f}, stdev {s['stdev_ms']:.2f}")
    r = res["fp8_over_bf16_pull"]
    print(f"FP8/bf16 pull: median {r['median']:.2f}x (best {r['best']:.2f}x, worst {r['worst']:.2f}x); floors "
          f"FP8 {res['fp8_floor_s'] * 1e3:.2f} ms, bf16 {res['bf16_floor_s'] * 1e3:.2f} ms; FP8 push median "
          f"{res['fp8_push_s'] * 1e3:.1f} ms")
    print(f"FP8 bit-equal to SGLang's load of the FP8 checkpoint ({res['params_checked']} params): pull "
          f"{not res['fp8_pull_mismatched']}, push {not res['fp8_push_mismatched']}; differences by kind: pull "
          f"{res['fp8_pull_mismatch_kinds']}, push {res['fp8_push_mismatch_kinds']} (explain(); diagnosis in the JSON)")
    print(f"generate: FP8 {res['fp8_tokens_per_s']:.0f} tok/s, bf16 {res['bf16_tokens_per_s']:.0f} tok/s; greedy "
          f"first token equal {res['first_token_agreement']:.0%}, |logprob gap| {res['first_token_logprob_gap_mean']}")
    save(res, out_dir, args.model, final=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
