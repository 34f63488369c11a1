"""Pull mode's engine side (runs inside SGLang's scheduler) on CPU: the loader resolves targets, caches sources
and tables, writes through the scatter kernel, and rejects every bad request with one message, writing nothing."""
import json
import re

import numpy as np
import pytest
import torch

from mtrain.reshard.pull import PullJob
from mtrain.rollout import sglang_loader as L
from mtrain.reshard import pull_protocol as P
from test_sglang_pure import TinySGLangLikeModel, status_dir  # noqa: F401 -- a fixture

QKV = "model.layers.0.self_attn.qkv_proj.weight"  # [16, 8] bf16
W13 = "model.layers.1.mlp.experts.w13_weight"  # [4, 6, 8] bf16
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"  # [4] fp32
KVB = "model.layers.1.self_attn.kv_b_proj.weight"  # [6, 4] bf16


@pytest.fixture
def pull_dir(status_dir):
    """The loader's status dir (test_sglang_pure's fixture) and a fresh pull state: a new scheduler process."""
    P.STATE.__init__()
    yield status_dir
    P.STATE.__init__()


def _job(src_a: torch.Tensor, src_b: torch.Tensor, key="plan1/0/0") -> PullJob:
    """qkv <- src_a (fp32 -> bf16 cast) as two row blocks; experts 1..2 of w13 <- src_b; bias <- src_a[:4];
    kv_b_proj: zero fill."""
    rows = [
        [0, 0, 0, 0, 0, 1, 64, 0],  # qkv rows 0..7: src_a elements 0..63
        [0, 64, 0, 64, 0, 1, 64, 0],  # qkv rows 8..15
        [1, 0, 0, 0, 0, 1, 96, 1],  # w13 rows [1, 3): 2 experts x 6 x 8
        [0, 0, 0, 0, 0, 1, 4, 2],  # bias (fp32 <- fp32)
        [-1, 0, 0, 0, 0, 1, 24, 3],  # kv_b_proj zeros
    ]
    targets = [(QKV, (16, 8)), (W13 + "@1:3", (2, 6, 8)), (BIAS, (4,)), (KVB, (6, 4))]
    srcs = [src_a, src_b]
    return PullJob(key, targets, np.asarray(rows, dtype=np.int64), srcs, "plan1:" + "s" * 16, nbytes=(128 + 96 + 24) * 2 + 16)


def _sources():
    g = torch.Generator().manual_seed(0)
    return torch.randn(128, generator=g), torch.randn(96, generator=g).to(torch.bfloat16)


def _check_written(m, a, b):
    p = dict(m.named_parameters())
    assert torch.equal(p[QKV], a.to(torch.bfloat16).view(16, 8))
    w13 = p[W13]
    assert torch.equal(w13[1:3], b.view(2, 6, 8)) and not w13[0].any() and not w13[3].any()
    assert torch.equal(p[BIAS], a[:4])
    assert not p[KVB].any()


def test_pull_writes_then_reuses_cached_sources_and_table(pull_dir):
    m = TinySGLangLikeModel()
    torch.nn.init.ones_(m.model.layers[1].self_attn.kv_b_proj.weight)
    a, b = _sources()
    job = _job(a, b)
    sender = P.PullSender(1)
    first = sender.payload(0, job, finish=False, marker=torch.empty(0))
    assert len(first) == 3 and "targets" in first[0][0]
    L.load_direct(m, first)
    assert L.collect_errors(pull_dir) == []
    sender.confirm(0, job)
    _check_written(m, a, b)
    # Next sync: the trainer changed its tensors in place; only the spec travels, the engine reads them again.
    a.mul_(2)
    b.add_(1)
    second = sender.payload(0, job, finish=True, marker=torch.empty(0))
    assert len(second) == 1 and "targets" not in second[0][0] and json.loads(
        second[0][0][len(P.PULL_PREFIX):])["n_sources"] == 0
    L.load_direct(m, second)
    assert L.collect_errors(pull_dir) == []
    _check_written(m, a, b)
    assert m.hook_calls == [[KVB]]  # finish ran DeepSeek's post-load hook on the touched kv_b_proj
    assert L._touched_since_finish == set()


def _spec(**over):
    spec = {"table": "plan1/0/0", "sources": "plan1:" + "s" * 16, "n_sources": 2, "finish": False,
            "targets": [[QKV, [16, 8]]], "rows": [[0, 0, 0, 0, 0, 1, 128, 0]]}
    spec.update(over)
    return {k: v for k, v in spec.items() if v is not None}


def _payload(spec, tensors):
    return [(P.PULL_PREFIX + json.dumps(spec), torch.empty(0))] + [(P.SOURCE_NAME, t) for t in tensors]


BAD = [
    (lambda a, b: [(P.PULL_PREFIX + "{nope", torch.empty(0))], "bad JSON spec"),
    (lambda a, b: _payload(_spec(finish="yes"), [a, b]), "field 'finish' must be a bool"),
    (lambda a, b: _payload(_spec(rows=None), [a, b]), "both 'targets' and 'rows' or neither"),
    (lambda a, b: _payload(_spec(), [a]), "spec says 2 sources, 1 tensors attached"),
    (lambda a, b: _payload(_spec(n_sources=0, sources="other"), []), "sources 'other' are not held"),
    (lambda a, b: _payload(_spec(targets=None, rows=None, table="plan1/9/0"), [a, b]),
     "table 'plan1/9/0' is not held"),
    (lambda a, b: _payload(_spec(targets=[["model.layers.0.self_attn.qkv_prj.weight", [16, 8]]]), [a, b]),
     r"no parameter 'model.layers.0.self_attn.qkv_prj.weight'.*closest"),
    (lambda a, b: _payload(_spec(targets=[[QKV, [8, 16]]]), [a, b]),
     r"plan has shape \(8, 16\), the engine's parameter \(16, 8\)"),
    (lambda a, b: _payload(_spec(targets=[[W13 + "@3:5", [2, 6, 8]]]), [a, b]),
     r"w13_weight@3:5: rows \[3, 5\) out of range for model.layers.1.mlp.experts.w13_weight with 4 rows"),
    (lambda a, b: _payload(_spec(rows=[[0, 64, 0, 0, 0, 1, 128, 0]]), [a, b]), "does not fit: .*reads src 0"),
    (lambda a, b: _payload(_spec(rows=[[0, 0, 0, 0, 0, 1, 128, 1]]), [a, b]), "does not fit"),
    (lambda a, b: _payload(_spec(rows=[[0, 0, 0]]), [a, b]), r"must be \[N, 8\]"),
    (lambda a, b: [(P.PULL_PREFIX + json.dumps(_spec()), torch.empty(0)), ("x", a), (P.SOURCE_NAME, b)],
     "must be named"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m for _, m in BAD])
def test_bad_pull_is_reported_and_nothing_is_written(pull_dir, make, message):
    m = TinySGLangLikeModel()
    a, b = _sources()
    good = _job(a.clone(), b.clone(), key="plan1/0/0")
    sender = P.PullSender(1)
    L.load_direct(m, sender.payload(0, good, False, torch.empty(0)))
    assert L.collect_errors(pull_dir) == []
    before = {k: v.clone() for k, v in m.named_parameters()}
    held = (P.STATE.sources_key, list(P.STATE.tables))
    L.load_direct(m, make(a * 3, b * 3))  # must not raise (a raise in the scheduler kills the trainer)
    errors = L.collect_errors(pull_dir)
    assert len(errors) == 1 and "LoaderError" in errors[0], errors
    assert re.search(message, errors[0]), errors[0]
    assert all(torch.equal(before[k], v) for k, v in m.named_parameters())
    assert (P.STATE.sources_key, list(P.STATE.tables)) == held  # a bad request never replaces what is held


def test_sender_resends_everything_after_forget():
    a, b = _sources()
    job = _job(a, b)
    s = P.PullSender(2)
    s.confirm(1, job)
    assert len(s.payload(1, job, False, torch.empty(0))) == 1
    assert len(s.payload(0, job, False, torch.empty(0))) == 3  # another rank holds nothing yet
    s.forget()
    assert len(s.payload(1, job, False, torch.empty(0))) == 3
