"""Separate placement's arithmetic and refusals, without processes: the engine groups (who leads which engine), the
training layout every rank derives, and each refusal as one line naming its key."""
import pytest

from loop_harness import CONFIG
from mtrain.config import ConfigError, load_config
from mtrain.job_split import check_placement_runs, split_ranks, train_world
from mtrain.rollout.groups import EngineLayoutError
from mtrain.rollout.separate_groups import SeparateGroups

BASE = ["model.hf_path=x", "engine.placement=separate", "engine.ranks=2", "train.save_interval=-1"]


def test_groups_lead_engines_on_the_last_ranks_only():
    g = SeparateGroups(world_size=6, first=2, tp=2, local_world_size=6)
    assert g.count == 2 and [g.leader(i) for i in range(2)] == [2, 4] and g.ranks(1) == [4, 5]
    assert [g.is_leader(r) for r in range(6)] == [False, False, True, False, True, False]
    assert [g.group_of(r) for r in range(6)] == [None, None, 0, 0, 1, 1]
    assert g.owner(1, 1) == 5 and g.sglang_placement(4, local_rank=4) == {"tp_size": 2, "base_gpu_id": 4}
    with pytest.raises(EngineLayoutError):
        SeparateGroups(world_size=5, first=2, tp=2, local_world_size=5)


def test_training_world_and_layout():
    from mtrain.trainer.publishers.separate import training_layout
    cfg = load_config(CONFIG, BASE + ["parallel.tp=2"])
    assert train_world(cfg, 6) == 4 and split_ranks(cfg, 6).train_ranks == (0, 1, 2, 3)
    lay = training_layout(cfg, 4)
    assert (lay.tp, lay.dp, lay.expert_tp, lay.world) == (2, 2, 2, 4)
    check_placement_runs(split_ranks(cfg, 6), cfg)  # runs
    for extra in (["train.save_interval=2"], ["rollout.async=stream", "rollout.max_staleness=2"]):
        check_placement_runs(split_ranks(cfg, 4), load_config(CONFIG, BASE + extra))  # checkpoints, stream: run


@pytest.mark.parametrize("extra, key", [
    (["engine.kind=sglang", "engine.tp=2"], "engine.tp"),
])
def test_refused_in_one_line(extra, key):
    try:
        cfg = load_config(CONFIG, BASE + extra)
        check_placement_runs(split_ranks(cfg, 4), cfg)
    except ConfigError as e:
        assert str(e).startswith(f"{key}:") and "\n" not in str(e), str(e)
        return
    raise AssertionError("not refused")
