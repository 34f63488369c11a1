"""Static instruction count per thread of the block-FP8 kernel (kernels/triton_fp8.py), compiled for sm_90 on CPU.

    python benchmarks/fp8_kernel_ptx_count.py                    # default knobs (STEP_ROWS, WARPS, HW_CVT)
    python benchmarks/fp8_kernel_ptx_count.py --slots 2 --json out.json

No GPU needed: triton.compile for GPUTarget("cuda", 90, 32) runs the whole pipeline on the host (ptxas and nvdisasm
ship with Triton). For the general path (FAST=0: the sub-piece loop, per sub-piece masks and a select) and the
fast path (FAST=1: one sub-piece covers the block) it prints the PTX and SASS instruction counts, registers and a
few classes (global loads, compares, selects, divisions, conversions). The whole code counts: both kernels hold
the 16-byte-aligned and the element-wise (unaligned) load and store variants and the division's slow path; so
`sass_aligned_path` also counts the SASS instructions one thread issues on the common path (16-byte loads and
stores, no slow-path division; the general path's sub-piece loop once: a block of one sub-piece). The source slots
are bf16 (the sync's dtype), pointers 16-byte aligned as launch_fp8 passes them. Instruction counts only, not GPU
time: the H200 run (bench_fp8_kernel.py, MTRAIN_FP8_FAST=0 / 1) measures that.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must precede the first triton import: the kernel must be a JITFunction
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

PTR_ARGS = ("blocks_ptr", "sub_ptr", "info_ptr", "w_ptr", "s_ptr", "src0", "src1", "src2")
# (name, PTX pattern, SASS pattern): what the fast path removes (compares/selects), what both keep (loads, division)
CLASSES = [("global loads", r"^ld\.global", r"^LDG(?!STS)"), ("async copies", r"^cp\.async", r"^LDGSTS"), ("compares", r"^setp", r"^(ISETP|FSETP)"),
           ("selects", r"^(selp|slct)", r"^(SEL|FSEL)"), ("divisions", r"^div", r"^MUFU\.RCP"),
           ("conversions", r"^cvt", r"^F2F|^F2FP"), ("global stores", r"^st\.global", r"^STG")]


def compile_kernel(fast: bool, slots: int, step: int, warps: int, hw_cvt: bool, maxnreg: int | None = None,
                   block=(128, 128), rcp_div: bool = True, pipeline: int = 0):
    from mtrain.kernels import triton_fp8 as tf
    from mtrain.kernels.fp8 import BLOCK_FIELDS, FP8_MAX, SUB_FIELDS

    fn = tf._fp8_blocks_kernel
    sig = {"blocks_ptr": "*i64", "sub_ptr": "*i64", "info_ptr": "*i64", "w_ptr": "*u8", "w_delta": "i64",
           "s_ptr": "*fp32", "s_delta": "i64", "src0": "*bf16", "src1": "*bf16", "src2": "*bf16", "n_blocks": "i32"}
    cx = dict(N_SLOTS=slots, VEC0=8, VEC1=8, VEC2=8, BN=block[0], BK=block[1], STEP=step, FIELDS=BLOCK_FIELDS,
              SUBF=SUB_FIELDS, FMAX=FP8_MAX, HW_CVT=hw_cvt, FAST=fast, RCP_DIV=rcp_div,
              ALIGNED=bool(pipeline and fast), STAGES=pipeline if fast else 0,
              CHANNEL=False, HW_RCP=False, SCALE_MUL=0.0, FTZ_MIN=0.0)  # block FP8: the per-channel path off
    sig.update({k: "constexpr" for k in cx})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in PTR_ARGS}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptx_instructions(ptx: str) -> list[str]:
    """Instruction lines of the kernel body: not directives, labels, braces or comments."""
    body = ptx[ptx.index(".entry"):]
    out = []
    for line in body.splitlines():
        t = line.strip()
        if not t or t.startswith(("//", ".", "{", "}", ")", "(")) or t.endswith(":"):
            continue
        out.append(re.sub(r"^@!?%p\d+\s+", "", t))  # predicated: count the instruction
    return out


def _nv_tool(tool: str, cubin: bytes, *args: str) -> str:
    """Run one of the CUDA binary tools Triton bundles on a cubin."""
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(exe), *args, f.name], capture_output=True, text=True, check=True).stdout


def _sass(cubin: bytes) -> tuple[list[tuple[bool, str, str]], dict[str, int]]:
    """SASS from nvdisasm: [(predicated, opcode, text)] (NOPs and the trailing BRA-to-self padding left out)
    and {label: index of the instruction it names}."""
    ins, labels = [], {}
    for line in _nv_tool("nvdisasm", cubin, "-c").splitlines():
        if re.match(r"^[.$][\w$.]+:", line.strip()):
            labels[line.strip()[:-1]] = len(ins)
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m and not m.group(2).startswith("NOP"):
            ins.append((bool(m.group(1)), m.group(2), m.group(3)))
    while ins and ins[-1][1] == "BRA":
        ins.pop()
    return ins, labels


def sass_instructions(cubin: bytes) -> list[str]:
    return [op for _, op, _ in _sass(cubin)[0]]


def aligned_block_path(cubin: bytes) -> int:
    """Instructions one thread issues for a block read and written with 16-byte accesses: the shortest path from
    the entry to an EXIT through an LDG.E.128 and an STG.E.128 that avoids the unaligned element-wise variants
    (LDG.E.U16 / STG.E.U8) and the division's slow-path CALL (taken only for operands near the exponent range's
    ends). Back edges are dropped, so the general path's sub-piece loop counts once: a block of one sub-piece.
    Predicated-off instructions count: they issue all the same."""
    ins, labels = _sass(cubin)
    n, done, inf = len(ins), 3, float("inf")
    flag = [(op in ("LDG.E.128", "LDGSTS.E.BYPASS.128")) | (op == "STG.E.128") << 1 for _, op, _ in ins]
    banned = [op in ("LDG.E.U16", "STG.E.U8", "CALL.REL.NOINC") for _, op, _ in ins]
    cost = [[inf] * 4 for _ in range(n + 1)]  # cost[i][seen]: fewest instructions from i to an EXIT
    for i in range(n - 1, -1, -1):
        pred, op, rest = ins[i]
        if banned[i]:
            continue
        nxt = [] if (op in ("EXIT", "RET.REL.NODEC") or op == "BRA" and not pred) else [i + 1]
        if op == "BRA":
            nxt.append(labels[re.search(r"`\(([^)]+)\)", rest).group(1)])
        for seen in range(4):
            now = seen | flag[i]
            best = 0 if op == "EXIT" and now == done else inf
            for j in nxt:
                if j > i:  # a back edge: a loop's next round
                    best = min(best, cost[j][now])
            cost[i][seen] = best + 1
    return int(cost[0][0])


def count(fast: bool, **kw) -> dict:
    k = compile_kernel(fast, **kw)
    ptx, sass = ptx_instructions(k.asm["ptx"]), sass_instructions(k.asm["cubin"])
    # registers per thread: with 512 threads a program, 64 or fewer let two blocks share an SM; spilled bytes
    usage = _nv_tool("cuobjdump", k.asm["cubin"], "--dump-resource-usage")
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    res = {"ptx": len(ptx), "sass": len(sass), "sass_aligned_path": aligned_block_path(k.asm["cubin"]),
           "registers": regs, "stack_bytes": stack, "shared_bytes": k.metadata.shared}
    for name, pp, sp in CLASSES:
        res[name] = {"ptx": sum(bool(re.match(pp, i)) for i in ptx), "sass": sum(bool(re.match(sp, i)) for i in sass)}
    return res


def main() -> int:
    from mtrain.kernels import triton_fp8 as tf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=1, help="source dtype slots compiled in (1: all sources bf16)")
    ap.add_argument("--step", type=int, default=tf.STEP_ROWS)
    ap.add_argument("--warps", type=int, default=tf.WARPS)
    ap.add_argument("--hw-cvt", type=int, default=int(tf.HW_CVT))
    ap.add_argument("--maxnreg", type=int, default=tf.MAXNREG, help="register cap per thread (MTRAIN_FP8_MAXNREG)")
    ap.add_argument("--pipeline", type=int, default=tf.PIPELINE,
                    help="stages of the fast path's pipelined launch (MTRAIN_FP8_PIPELINE; 0: one block per program)")
    ap.add_argument("--rcp-div", type=int, default=int(tf.RCP_DIV), help="reciprocal division (MTRAIN_FP8_RCP_DIV)")
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args()
    kw = dict(slots=args.slots, step=args.step, warps=args.warps, hw_cvt=bool(args.hw_cvt), maxnreg=args.maxnreg,
              rcp_div=bool(args.rcp_div), pipeline=args.pipeline)
    res = {"knobs": kw, "triton": triton.__version__, "general": count(False, **kw), "fast": count(True, **kw)}
    g, f = res["general"], res["fast"]
    print(f"sm_90, {kw}: static instructions per thread (one program = one 128x128 block)")
    print(f"{'':16}{'general':>16}{'fast':>16}")
    for key in ("ptx", "sass", "sass_aligned_path", "registers", "stack_bytes", "shared_bytes"):
        print(f"{key:16}{g[key]:>16}{f[key]:>16}")
    for name, _, _ in CLASSES:
        print(f"{name:16}{'%d / %d' % (g[name]['ptx'], g[name]['sass']):>16}"
              f"{'%d / %d' % (f[name]['ptx'], f[name]['sass']):>16}   (ptx / sass)")
    print(f"fast / general: ptx {f['ptx'] / g['ptx']:.2f}, sass {f['sass'] / g['sass']:.2f}, "
          f"sass on the aligned path {f['sass_aligned_path'] / g['sass_aligned_path']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
