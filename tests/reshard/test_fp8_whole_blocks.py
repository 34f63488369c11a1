"""plan_blocks' WHOLE flag (kernels/fp8.py: the blocks the Triton FP8 kernel's fast path takes) on the planner's
real pull tables: fused qkv / gate_up with blocks straddling training-TP shards, engine-TP slices of a training
tensor (source row stride wider than the block), slotted MoE experts. The expectation is computed independently,
element by element from the table rows: a block is whole when one row writes all of it, from a source (not a
zero fill), at source addresses a + i * stride + j. The Triton result (interpreted) equals the torch executor's.
"""
import numpy as np
import pytest
import torch

from mtrain.kernels import BlockFp8, ScatterTable, execute_scatter
from mtrain.kernels.fp8 import FP8, WHOLE
from mtrain.kernels.scatter_fp8 import _split
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.reshard.pull import PullPlan

from test_fp8_sync import TRAIN, setup, to_megatron

CASES = [  # (config, training layout, engine (tp, ep), some blocks are not whole)
    ("llama_straddle", "tp2", (1, 1), True),  # 192-row gate/up and 192-col down shards straddle 128-blocks
    ("llama", "tp1", (2, 1), False),  # engine TP2 slices each training tensor (o/down: column slices of its rows)
    ("llama", "tp2", (4, 1), False),  # q/k/v and gate/up fused from aligned shards
    ("qwen3_moe", "tp2ep2", (2, 2), False),  # [E, N, K] w13 / w2: blocks restart at every expert
]


def pull_jobs(name, train, engine):
    """[(engine rank, PullJob)] of every bucket, sources from a bf16 trainer."""
    cfg, layout, hf, _, _ = setup(name)
    t = TRAIN[train]
    mcore = {k: v.to(torch.bfloat16) for k, v in to_megatron(layout, hf, t).items()}
    plan = build_plan(layout, t, SGLangLayout(tp=engine[0], ep=engine[1], fp8=True), colocate=lambda r: 0)
    ex = Executor(plan, 0, lambda ref: mcore[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch")
    return [(r, job) for bucket in PullPlan(ex).jobs() for r, job in sorted(bucket.items())]


def expected_whole(rows: np.ndarray, shape: tuple, block: tuple) -> dict[int, bool]:
    """{block id (scale index): whole?} for the blocks the rows write, from a per-element map of the writes."""
    slots, n, k = (1, *shape) if len(shape) == 2 else shape
    who = np.full(slots * n * k, -1)
    src = np.full(slots * n * k, -2)
    addr = np.zeros(slots * n * k, np.int64)
    for p, (si, so, ss, do, ds, nr, nc) in enumerate(rows[:, :7].tolist()):
        for r in range(nr):
            at = slice(do + r * ds, do + r * ds + nc)
            who[at], src[at], addr[at] = p, si, so + r * ss + np.arange(nc)
    who, src, addr = (x.reshape(slots * n, k) for x in (who, src, addr))
    bn, bk = block
    nbr, nbc = -(-n // bn), -(-k // bk)
    out = {}
    for e in range(slots):
        for bi in range(nbr):
            for bj in range(nbc):
                at = (slice(e * n + bi * bn, e * n + min(bi * bn + bn, n)), slice(bj * bk, min(bj * bk + bk, k)))
                w, s, a = who[at], src[at], addr[at]
                if (w < 0).all():
                    continue  # not written by this call: not in the plan
                stride = a[1, 0] - a[0, 0] if a.shape[0] > 1 else 0
                affine = a[0, 0] + np.arange(a.shape[0])[:, None] * stride + np.arange(a.shape[1])[None, :]
                out[(e * nbr + bi) * nbc + bj] = bool((w == w[0, 0]).all() and s[0, 0] >= 0 and (a == affine).all())
    return out


@pytest.mark.parametrize("name, train, engine, straddles", CASES)
def test_whole_flag_on_planner_tables(name, train, engine, straddles):
    n_whole = n_other = n_sliced = 0
    for _, job in pull_jobs(name, train, engine):
        specs = {i: BlockFp8(torch.empty(int(np.prod(q.scale_shape))), tuple(job.targets[i][1]), q.block)
                 for i, q in job.quant.items()}
        _, plans = _split(ScatterTable.from_rows(job.rows), specs)
        assert set(plans) == set(job.quant)
        for d, (blocks, subs, _) in plans.items():
            want = expected_whole(job.rows[job.rows[:, 7] == d], specs[d].shape, specs[d].block)
            assert dict(zip(blocks[:, 1].tolist(), (blocks[:, WHOLE] == 1).tolist())) == want, job.targets[d][0]
            one = subs[blocks[blocks[:, WHOLE] == 1, 5]]
            assert (one[:, 3:5] == 0).all()  # from the block's (0, 0): the fast path's assumption
            n_sliced += int((one[:, 2] != specs[d].shape[-1]).sum())  # a source row stride other than the weight's
            n_whole += int(blocks[:, WHOLE].sum())
            n_other += int((blocks[:, WHOLE] == 0).sum())
    assert n_whole > 0 and n_sliced > 0 and (n_other > 0) == straddles


@pytest.mark.parametrize("name, train, engine", [("llama_straddle", "tp2", (1, 1)), ("llama", "tp1", (2, 1))])
def test_planner_tables_through_both_paths_equal_torch(name, train, engine):
    """Fused, straddling and sliced layouts through the fast and general launches (interpreted) == torch."""
    for _, job in pull_jobs(name, train, engine):
        got = []
        for backend in ("torch", "triton"):
            dsts = [torch.zeros(int(np.prod(s)), dtype=FP8 if i in job.quant else torch.bfloat16)
                    for i, (_, s) in enumerate(job.targets)]
            quant = {i: BlockFp8(torch.zeros(int(np.prod(q.scale_shape))), tuple(job.targets[i][1]), q.block)
                     for i, q in job.quant.items()}
            execute_scatter(dsts, [s.view(-1) for s in job.sources], ScatterTable.from_rows(job.rows),
                            backend=backend, quant=quant)
            got.append(([d.view(torch.uint8) if d.dtype == FP8 else d for d in dsts], [q.scale for q in quant.values()]))
        for a, b in zip(got[0][0] + got[0][1], got[1][0] + got[1][1]):
            assert torch.equal(a, b)
