"""The SGLang kernels our configurations reach on an H200 that no engine run has exercised yet, called directly on
random inputs and checked against float64 PyTorch (docs/sglang-bundle-audit.md): about a minute, no engine start, so
a failure costs seconds instead of a scheduler death after a 40-110 s start.

Checks (each independent; one failing does not stop the others):
- bundle: sgl_kernel's compiled extensions (flash_ops / flashmla_ops are expected absent), and the modules a vision
  model needs (torchvision, PIL, einops: .gpu-extra/) and the memory saver.
- vision_attention: `context_attention_fwd` as `VisionTritonAttention` calls it (non-causal, varlen), head sizes 64
  (tiny VLM) and 80 (Qwen2.5-VL-7B's tower), against softmax(q k^T / sqrt(d)) v per sequence.
- vision_rotary: `apply_rotary_pos_emb` (torch.compile'd on CUDA: Inductor runs here) against the rotate-half formula.
- fused_rope: the JIT rope (`apply_rope_with_cos_sin_cache_inplace`, nvcc) for head sizes 64 and 128, neox style.
- deepseek_topk: flashinfer's JIT `fused_topk_deepseek` (noaux_tc grouped top-k) for 16 experts / 4 groups (the small
  model) and 256 / 8 (the release), against the DeepSeek-V3 gate in float64.

Run on the GPU machine from the repository root, `.gpu/` carried:
    source benchmarks/gpu_setup.sh && python benchmarks/gpu_kernel_preflight.py --out $OUT/kernel_preflight.json
Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback

import torch


def check_bundle() -> dict:
    from mtrain.rollout.sglang_preflight import VISION_MODULES, sgl_kernel_extensions
    ext = sgl_kernel_extensions()
    missing = [m for m in (*VISION_MODULES, "torch_memory_saver", "flashinfer") if importlib.util.find_spec(m) is None]
    import sgl_kernel  # noqa: F401 - loads common_ops for this GPU's architecture
    return {"ok": not missing and ext is not None and "common_ops" in ext,
            "sgl_kernel_extensions": sorted(ext or []), "missing_modules": missing}


def check_vision_attention() -> dict:
    from sglang.kernels.ops.attention.prefill_attention import context_attention_fwd
    out = {}
    for d in (64, 80):
        g = torch.Generator(device="cuda").manual_seed(d)
        lens = [37, 256, 5]
        n, h = sum(lens), 4
        q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        o = torch.empty_like(q)
        context_attention_fwd(q, k, v, o, cu, cu[1:] - cu[:-1], max(lens), is_causal=False)  # vision.py:496-506
        err = 0.0
        for i in range(len(lens)):
            s = slice(int(cu[i]), int(cu[i + 1]))
            qq, kk, vv = (x[s].double().transpose(0, 1) for x in (q, k, v))
            ref = torch.softmax(qq @ kk.transpose(1, 2) / d ** 0.5, dim=-1) @ vv
            err = max(err, _rel_err(o[s].transpose(0, 1), ref))
        out[f"head_{d}_max_rel_err"] = err
    out["ok"] = all(v < 3e-2 for v in out.values())
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (|ref| + 1): bf16 outputs carry about 2^-8 relative error, more near zero is noise."""
    return ((out.double() - ref) / (ref.abs() + 1)).abs().max().item()


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def check_vision_rotary() -> dict:
    from sglang.srt.layers.rotary_embedding import apply_rotary_pos_emb
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    ang = torch.rand(300, 32, device="cuda", generator=g) * 6.28
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # vision.py:1396-1398
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    err = max(_rel_err(qo, q.double() * c + _rotate_half(q.double()) * s),
              _rel_err(ko, k.double() * c + _rotate_half(k.double()) * s))
    return {"ok": err < 3e-2, "max_rel_err": err}


def check_fused_rope() -> dict:
    from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace
    out = {}
    for d in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(d)
        pos = torch.randint(0, 1000, (77,), device="cuda", generator=g)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d))
        freqs = torch.arange(1024, device="cuda", dtype=torch.float64)[:, None] * inv[None]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # SGLang's layout: [max_pos, cos | sin]
        q = torch.randn(77, 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(77, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
        q0, k0 = q.double(), k.double()
        apply_rope_with_cos_sin_cache_inplace(q, k, cache, pos, is_neox=True)
        c = freqs[pos].cos().repeat(1, 2).unsqueeze(1)
        s = freqs[pos].sin().repeat(1, 2).unsqueeze(1)
        err = max(_rel_err(q, q0 * c + _rotate_half(q0) * s), _rel_err(k, k0 * c + _rotate_half(k0) * s))
        out[f"head_{d}_max_rel_err"] = err
    out["ok"] = all(v < 3e-2 for v in out.values())
    return out


def _deepseek_gate(logits, bias, n_group, topk_group, topk):
    """DeepSeek-V3's noaux_tc gate (modeling_deepseek.MoEGate) in float64: ids chosen on sigmoid + bias, group score =
    sum of its two best biased scores, weights = the unbiased sigmoid scores renormalised."""
    scores = logits.double().sigmoid()
    biased = scores + bias.double()
    t, e = scores.shape
    group = biased.view(t, n_group, -1).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(topk_group, dim=-1).indices, 1)
    mask = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    ids = biased.masked_fill(mask == 0, float("-inf")).topk(topk, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True)


def check_deepseek_topk() -> dict:
    from flashinfer.fused_moe import fused_topk_deepseek
    out = {}
    for e, n_group, topk_group, topk in ((16, 4, 2, 4), (256, 8, 4, 8)):
        g = torch.Generator(device="cuda").manual_seed(e)
        logits = torch.randn(93, e, device="cuda", generator=g)
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        w = torch.empty(93, topk, device="cuda", dtype=torch.float32)
        ids = torch.empty(93, topk, device="cuda", dtype=torch.int32)
        fused_topk_deepseek(logits, bias, n_group, topk_group, topk, 1.0, w, ids, True)  # topk.py:1487-1497
        ref_ids, ref_w = _deepseek_gate(logits, bias, n_group, topk_group, topk)
        order, ref_order = ids.long().sort(-1), ref_ids.sort(-1)
        same = bool((order.values == ref_order.values).all())
        err = (w.double().gather(1, order.indices) - ref_w.gather(1, ref_order.indices)).abs().max().item()
        out[f"experts_{e}"] = {"same_ids": same, "weight_max_abs_err": err}
    out["ok"] = all(v["same_ids"] and v["weight_max_abs_err"] < 1e-3 for v in out.values())
    return out


CHECKS = {"bundle": check_bundle, "vision_attention": check_vision_attention, "vision_rotary": check_vision_rotary,
          "fused_rope": check_fused_rope, "deepseek_topk": check_deepseek_topk}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kernel_preflight.json")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {sorted(CHECKS)}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernel_preflight.py: needs a CUDA GPU and the SGLang bundle (source benchmarks/gpu_setup.sh)")
    report = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            res = CHECKS[name]()
        except Exception as e:  # the point is to see every failure in one call
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        report[name] = res
        print(f"{name}: {'PASS' if res['ok'] else 'FAIL'} ({res['seconds']} s) "
              f"{ {k: v for k, v in res.items() if k not in ('ok', 'traceback', 'seconds')} }", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(report[n]["ok"] for n in args.only.split(",")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
