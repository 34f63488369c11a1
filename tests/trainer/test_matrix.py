"""The feature matrix (issue 42): rollout mode x generation x learner x LoRA x routing replay x placement, each cell a
real `torchrun -m mtrain train` of 2 steps on CPU (tiny models, float32, gloo; 2 ranks colocated, 2 training + 2
engine ranks separate). What a cell must show, and the list of cells refused today: tests/trainer/matrix_harness.py.

The default suite runs SLICE, cells chosen so that every value of every axis runs at least once, two of them killed
and resumed; MTRAIN_SLOW=1 adds the pairwise covering set of the axes (every pair of values of two axes appears in
some cell), listed in the test ids as rollout-generation-learner-lora-routing-placement.
"""
from __future__ import annotations

import pytest

from matrix_harness import (AXES, EXCLUDED, Cell, KnownRefusal, check_run, models, overrides, pairwise_cells,
                            refusals, run_cell)

SLICE = [
    Cell("off", "agent", "ppo", "off", "replay", "separate_tp1"),
    Cell("partial", "tools", "distill", "on", "off", "colocated"),
    Cell("one_step", "single", "grpo", "experts", "off", "separate_tp2"),
    Cell("stream", "agent", "ppo", "off", "off", "colocated"),
]
PAIRWISE = pairwise_cells()
CELLS = PAIRWISE + [c for c in SLICE if c not in PAIRWISE]


def _param(cell: Cell):
    keys = [key for key, _ in refusals(cell)]
    marks = [pytest.mark.xfail(strict=True, raises=KnownRefusal, reason=f"refused today: {'; '.join(keys)}")] \
        if keys else []
    if cell not in SLICE:
        marks.append(pytest.mark.slow)
    return pytest.param(cell, id=cell.id, marks=marks)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return models(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell(cell, hf, tmp_path):
    out = run_cell(cell, hf, tmp_path)
    recs = check_run(cell, out)
    print(f"{cell.id}: {out['wall_s']:.0f} s, step-1 gap {recs[1]['logprob_diff/max_abs']:.2e}")


def test_slice_holds_every_value_and_the_pairs_are_covered():
    """The default slice runs every value of every axis that runs today (once a refusal goes, its value must join
    the slice); the covering set holds every pair of values that an allowed cell holds (the generator's own claim,
    checked from the outside)."""
    import itertools

    from matrix_harness import _pairs, excluded
    assert not any(refusals(c) for c in SLICE)
    for axis in AXES:
        assert {getattr(c, axis) for c in SLICE} == {getattr(c, axis) for c in PAIRWISE if not refusals(c)}, axis
    allowed = [Cell(*v) for v in itertools.product(*AXES.values())]
    need = set().union(*(_pairs(c) for c in allowed if not excluded(c)))
    assert need <= set().union(*(_pairs(c) for c in PAIRWISE))


@pytest.mark.parametrize("reason,cell,pattern", [pytest.param(r, c, p, id=c.id) for r, _, c, p in EXCLUDED])
def test_excluded_combinations_are_still_refused(reason, cell, pattern, tmp_path):
    """What the matrix leaves out is refused by the config checks in one ConfigError: once one runs, this fails and
    the combination belongs in the matrix (matrix_harness.EXCLUDED)."""
    from loop_harness import CONFIG
    from mtrain.config import ConfigError, load_config
    fake = {f"{a}/{r}": tmp_path / a / r for a in ("llama", "qwen3_moe") for r in ("student", "teacher")}
    with pytest.raises(ConfigError, match=pattern):
        load_config(CONFIG, overrides(cell, fake, tmp_path / "run"))
