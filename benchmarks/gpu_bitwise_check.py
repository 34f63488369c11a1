"""numerics.on_policy=bitwise on the GPU, kernel by kernel (compiled Triton, bf16): what the engine and the trainer
must agree on, checked for bit equality, and what the fixed kernels cost against cuBLAS / SDPA.

1. `bitwise_gpu.linear`: a row's output is the same in calls of 1, 7, 64 and 333 rows, and a column's the same in a
   slice of the weight (the trainer's fused QKV orders columns differently from SGLang's).
2. `bitwise_gpu.paged_attention`: the engine's paths to a token (a prefill, a chunk over a cached prefix, one decode
   step at a time, keys at scattered cache slots) equal the same kernel over the trainer's packed sequences; the same
   for `segment_attention` (several query tokens per program, the mode's default), with their times.
3. torch's softmax and log (SGLang's sampler computes the returned logprob with them): a row's result does not
   depend on how many rows the call has (the trainer reproduces the sampler with the same ops on other row counts).
4. `bitwise_moe_ops.moe` (Qwen3-MoE): a token's experts and output are the same whatever other tokens share its call
   (the engine routes a decode batch, the trainer a packed micro-batch), so the two sides route alike without
   routing replay.
5. `bitwise_gpu_elementwise`'s one-launch silu_mul and RoPE: a row's bits in any row count, and their time against
   the torch forms (float64 silu, float32 RoPE in several launches) they replace.
6. Cost: the fixed linear vs cuBLAS at the SmolLM2 and Qwen3-1.7B shapes, the attention vs SDPA (forward).
7. Candidate tiles for the linear (`--tiles`): each one's time against cuBLAS on the SmolLM2 and Qwen3-1.7B layer
   shapes, whether a row's output stays the same at 1, 7 and 333 rows, and whether it equals the mode's tile's
   (a smaller tile for the engine's decode batches would need that). Measures only: the mode keeps
   `bitwise_gpu.LINEAR_TILE` (a tile change is a change of bits on both sides).

Usage (GPU machine, after `source benchmarks/gpu_setup.sh`): python benchmarks/gpu_bitwise_check.py --out F.json
Exit code 1 when any equality fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from mtrain.kernels import bitwise_gpu as g


def _timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check_linear(gen) -> dict:
    out = {}
    for name, (k, n) in {"smollm2_qkv": (576, 960), "qwen3_1_7b_fc1": (2048, 12288)}.items():
        x = torch.randn(333, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        full = g.linear_fp32(x, w)
        rows_equal = all(torch.equal(g.linear_fp32(x[a:b], w), full[a:b])
                         for a, b in ((0, 1), (100, 101), (5, 12), (64, 128), (3, 333)))
        cols_equal = torch.equal(g.linear_fp32(x, w[37:301]), full[:, 37:301])
        ref = x.double() @ w.double().t()
        err = float((full.double() - ref).abs().max() / ref.abs().max())
        for m in (64, 4096):
            xm = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ours = _timed(lambda: g.linear(xm, w))
            cublas = _timed(lambda: xm @ w.t())
            out[f"{name}_m{m}_time_ratio"] = ours / cublas
        out[name] = {"rows_equal": rows_equal, "cols_equal": cols_equal, "rel_err_vs_float64": err}
    return out


def check_attention(gen) -> dict:
    out = {}
    for name, (h, hkv, d) in {"smollm2": (9, 3, 64), "qwen3": (16, 8, 128)}.items():
        lengths = [1100, 37, 300]
        total = sum(lengths)
        q = torch.randn(total, h, d, device="cuda", generator=gen).bfloat16()
        k = torch.randn(total, hkv, d, device="cuda", generator=gen).bfloat16()
        v = torch.randn(total, hkv, d, device="cuda", generator=gen).bfloat16()
        cu = [0, lengths[0], lengths[0] + lengths[1], total]
        scale = d ** -0.5
        # each kernel's own trainer form: packed_paged_attention is the mode's (bitwise_gpu.ATTENTION), and the
        # per-token kernel's engine paths are compared with the per-token kernel over the packed sequences
        ptable, prows, ppos = g.packed_tables(cu, "cuda")
        trainer = g.paged_attention(q, k, v, ptable, prows, ppos, scale)
        n = lengths[0]
        slots = torch.randperm(4000, device="cuda", generator=gen)[:n]
        kc = torch.zeros(4000, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kc[slots], vc[slots] = k[:n], v[:n]
        table = torch.zeros(8, 2048, device="cuda", dtype=torch.int32)
        table[5, :n] = slots.to(torch.int32)
        pieces = [(0, 500), (500, 1000)] + [(p, p + 1) for p in range(1000, n)]
        equal = True
        for a, b in pieces:
            rows = torch.full((b - a,), 5, device="cuda", dtype=torch.int32)
            pos = torch.arange(a, b, device="cuda", dtype=torch.int32)
            equal &= torch.equal(g.paged_attention(q[a:b], kc, vc, table, rows, pos, scale), trainer[a:b])
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:n].transpose(0, 1)[None].float(), k[:n].transpose(0, 1).repeat_interleave(h // hkv, 0)[None].float(),
            v[:n].transpose(0, 1).repeat_interleave(h // hkv, 0)[None].float(), is_causal=True, scale=scale)[0]
        err = float((trainer[:n].float() - ref.transpose(0, 1)).abs().max())
        ours = _timed(lambda: g.paged_attention(q, k, v, ptable, prows, ppos, scale), 5)
        sdpa = _timed(lambda: [torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1).repeat_interleave(h // hkv, 0)[None],
            v[a:b].transpose(0, 1).repeat_interleave(h // hkv, 0)[None], is_causal=True, scale=scale)
            for a, b in zip(cu[:-1], cu[1:])], 5)
        # segment_attention (bitwise_gpu.SEGMENT_TOKENS query tokens per program, the mode's default): the same paths
        seg = {}
        try:
            sstart, slen = g.sequence_segments(cu[:-1], lengths, "cuda")
            seg_trainer = g.segment_attention(q, k, v, ptable, prows, ppos, sstart, slen, scale)
            seg_equal = True
            for a, b in pieces:
                st, sl = g.sequence_segments([0], [b - a], "cuda")
                rows = torch.full((b - a,), 5, device="cuda", dtype=torch.int32)
                pos = torch.arange(a, b, device="cuda", dtype=torch.int32)
                seg_equal &= torch.equal(g.segment_attention(q[a:b], kc, vc, table, rows, pos, st, sl, scale),
                                         seg_trainer[a:b])
            seg_time = _timed(lambda: g.segment_attention(q, k, v, ptable, prows, ppos, sstart, slen, scale), 5)
            seg = {"segment_engine_paths_equal_trainer": bool(seg_equal),
                   "segment_max_abs_err_vs_float32_sdpa": float((seg_trainer[:n].float() - ref.transpose(0, 1))
                                                                .abs().max()),
                   "segment_forward_time_ratio_vs_sdpa": seg_time / sdpa}
        except Exception as e:  # noqa: BLE001
            seg = {"segment_error": f"{type(e).__name__}: {str(e)[:300]}"}
        out[name] = {"engine_paths_equal_trainer": bool(equal), "max_abs_err_vs_float32_sdpa": err,
                     "forward_time_ratio_vs_sdpa": ours / sdpa, **seg}
    return out


# (BM, BN, BK, warps, stages, group_m); group_m 1 is the plain row-major launch order, for comparison
TILE_CANDIDATES = [(64, 128, 64, 4, 4, 8), (64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 3, 8), (128, 128, 64, 4, 3, 8),
                   (128, 256, 64, 8, 3, 8), (64, 256, 64, 4, 3, 8), (128, 64, 64, 4, 4, 8), (64, 128, 32, 4, 5, 8)]
TILE_SHAPES = {"smollm2_qkv": (576, 960), "smollm2_down": (1536, 576), "qwen3_1_7b_qkv": (2048, 4096),
               "qwen3_1_7b_fc1": (2048, 12288), "qwen3_1_7b_fc2": (6144, 2048), "qwen3_head": (2048, 151936)}


def sweep_tiles(gen) -> dict:
    out = {}
    for tile in TILE_CANDIDATES:
        name = "x".join(map(str, tile))
        res = {}
        try:
            for shape, (k, n) in TILE_SHAPES.items():
                w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
                x = torch.randn(333, k, device="cuda", generator=gen).bfloat16()
                full = g._linear_forward(x, w, torch.float32, tile)
                res[f"{shape}_rows_equal"] = all(torch.equal(g._linear_forward(x[a:b], w, torch.float32, tile),
                                                             full[a:b]) for a, b in ((0, 1), (100, 107), (3, 333)))
                # the same bits as the mode's tile: then the engine's decode could take this tile while the trainer
                # keeps LINEAR_TILE (a row's K chunks and instruction are what fix its bits, if not the row block)
                res[f"{shape}_equals_mode_tile"] = torch.equal(full, g._linear_forward(x, w, torch.float32))
                xm = torch.randn(4096, k, device="cuda", generator=gen).bfloat16()
                res[f"{shape}_m4096_time_ratio"] = (_timed(lambda: g._linear_forward(xm, w, torch.bfloat16, tile))
                                                    / _timed(lambda: xm @ w.t()))
        except Exception as e:  # a tile the compiler or the GPU cannot take (shared memory): recorded, not fatal
            res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[name] = res
        print(f"tile {name}: {res}", flush=True)
    return out


def check_moe(gen) -> dict:
    from mtrain.kernels import bitwise_moe_ops as moe_ops
    e, k, h, inter, n = 32, 8, 1024, 384, 333  # the qwen3moe shape of gpu_bitwise.sh
    x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    router = (torch.randn(e, h, device="cuda", generator=gen) * 0.02).bfloat16()
    gate_up = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(e, h, inter, device="cuda", generator=gen) * 0.02).bfloat16()
    expert = moe_ops.fused_experts(gate_up, down)
    full, ids = moe_ops.moe(x, router, k, True, expert)
    same_routes, same_out = True, True
    for a, b in ((0, 1), (100, 101), (5, 12), (64, 128), (3, 333)):
        part, part_ids = moe_ops.moe(x[a:b], router, k, True, expert)
        same_routes &= torch.equal(part_ids, ids[a:b])
        same_out &= torch.equal(part, full[a:b])
    return {"qwen3moe": {"routes_equal": bool(same_routes), "outputs_equal": bool(same_out),
                         "experts_used": int(ids.unique().numel())}}


def check_elementwise(gen) -> dict:
    """The one-launch silu_mul and RoPE (bitwise_gpu_elementwise): a row's bits in calls of 1, 7 and 333 rows, and
    their time against the torch forms they replace, at Qwen3-1.7B's MLP width and head layout, 4,096 tokens."""
    from mtrain.kernels import bitwise_gpu_elementwise as e
    from mtrain.kernels import bitwise_ops as ops
    t, f, heads, dim = 4096, 6144, 16, 128
    fused = torch.randn(t, 2 * f, device="cuda", generator=gen).bfloat16()
    gate, up = fused[:, :f], fused[:, f:]
    q = torch.randn(t, heads, dim, device="cuda", generator=gen).bfloat16()
    pos = torch.arange(t, device="cuda")
    ang = pos.double()[:, None] * ops._inv_freq(1e6, dim, pos.device)[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    silu, rot = e.silu_mul(gate, up), e.rope(q, cos, sin)
    rows = ((0, 1), (100, 107), (3, 336))
    out = {"silu_mul_rows_equal": all(torch.equal(e.silu_mul(gate[a:b], up[a:b]), silu[a:b]) for a, b in rows),
           "rope_rows_equal": all(torch.equal(e.rope(q[a:b], cos[a:b], sin[a:b]), rot[a:b]) for a, b in rows)}

    def torch_silu_mul():
        g = gate.double()
        return ((g / (1.0 + torch.exp(-g))).float() * up.float()).to(gate.dtype)

    def torch_rope():
        c, s, xf = cos[:, None, :], sin[:, None, :], q.float()
        return torch.cat([xf[..., :dim // 2] * c - xf[..., dim // 2:] * s,
                          xf[..., dim // 2:] * c + xf[..., :dim // 2] * s], dim=-1).to(q.dtype)
    out["silu_mul_ms"] = 1e3 * _timed(lambda: e.silu_mul(gate, up))
    out["silu_mul_torch_ms"] = 1e3 * _timed(torch_silu_mul)
    out["rope_ms"], out["rope_torch_ms"] = 1e3 * _timed(lambda: e.rope(q, cos, sin)), 1e3 * _timed(torch_rope)
    out["silu_mul_max_abs_vs_torch"] = float((silu.float() - torch_silu_mul().float()).abs().max())
    return {"qwen3_1_7b_4096": out}


def check_softmax(gen) -> dict:
    out = {}
    for vocab in (49152, 151936):
        x = torch.randn(300, vocab, device="cuda", generator=gen) * 4
        full = torch.log(torch.softmax(x, dim=-1))
        ls = torch.log_softmax(x, dim=-1)
        equal = all(torch.equal(torch.log(torch.softmax(x[a:b].clone(), dim=-1)), full[a:b]) and
                    torch.equal(torch.log_softmax(x[a:b].clone(), dim=-1), ls[a:b])
                    for a, b in ((0, 1), (17, 18), (3, 10), (0, 256), (44, 300)))
        out[f"vocab_{vocab}_rows_equal"] = bool(equal)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/bitwise_kernels.json")
    ap.add_argument("--tiles", action="store_true", help="also time candidate linear tiles (section 7)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "linear": check_linear(gen), "attention": check_attention(gen),
           "moe": check_moe(gen), "elementwise": check_elementwise(gen), "softmax": check_softmax(gen)}
    if args.tiles:
        res["linear_tiles"] = sweep_tiles(gen)
    print(json.dumps(res, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    flags = [v for part in ("linear", "attention", "moe", "elementwise") for m in res[part].values() if isinstance(m, dict)
             for key, v in m.items() if key.endswith("equal") or key.endswith("_equal_trainer")]
    flags += [False for m in res["attention"].values() if "segment_error" in m]  # the mode's attention must run
    flags += list(res["softmax"].values())
    ok = all(flags)
    print(f"gpu_bitwise_check: {'all equal' if ok else 'NOT EQUAL'} ({sum(map(bool, flags))}/{len(flags)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
