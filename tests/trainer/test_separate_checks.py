"""Separate placement's arithmetic and refusals, without processes: the engine groups (who leads which engine), the
training layout every rank derives, and each refusal as one line naming its key."""
import pytest

from loop_harness import CONFIG
from mtrain.config import ConfigError, load_config
from mtrain.job_split import split_ranks, train_world
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
    for extra in (["train.save_interval=2"], ["rollout.async=stream", "rollout.max_staleness=2"]):
        assert split_ranks(load_config(CONFIG, BASE + extra), 4).engine_ranks == (2, 3)  # checkpoints, stream: run


def test_agents_lora_and_sglang_engine_tp_run_separate():
    """serve.agent, LoRA (with stream too) and SGLang engines of engine.tp > 1 are not refused with separate
    placement: the config checks pass and the ranks split."""
    for extra in (["serve.agent=tests.trainer.agents_for_tests:two_turn_digits"], ["engine.kind=sglang", "engine.tp=2"],
                  ["model.lora.targets=qkv,o_proj", "rollout.async=stream"]):
        cfg = load_config(CONFIG, BASE + extra)
        assert split_ranks(cfg, 4).engine_ranks == (2, 3)


def test_sglang_engine_tp2_shards_reach_the_ranks_on_its_schedulers_gpus():
    """SGLang at engine.tp > 1 under separate placement: destination rank r of engine g is received by global rank
    leader(g) + r (the ranks tests/reshard/test_remote_sync.py syncs bit-equal to SGLang's own slicing), and that
    rank's GPU is the one SGLang's scheduler r runs on: the leader starts its schedulers from base_gpu_id = its
    local rank, one GPU per engine rank. 2 nodes of 8 ranks, 8 training ranks, 2 engines of TP4 on the second."""
    from mtrain.reshard.remote import EngineRanks
    from mtrain.trainer.publishers.separate import destination_ranks
    g = SeparateGroups(world_size=16, first=8, tp=4, local_world_size=8)
    assert g.straddling() is None
    sg = destination_ranks(g, 4)
    assert sg == EngineRanks.after(8, 8, 4) == EngineRanks(((8, 9, 10, 11), (12, 13, 14, 15)))
    for e in range(g.count):
        leader = g.leader(e)
        base = g.sglang_placement(leader, local_rank=leader % 8)
        assert base["tp_size"] == 4
        for r, owner in enumerate(sg.engines[e]):
            assert sg.engine_of(owner) == (e, r) and base["base_gpu_id"] + r == owner % 8
    # the reference engine (one destination rank) receives on the leader; its other group ranks receive nothing
    ref = destination_ranks(g, 1)
    assert ref.engines == ((8,), (12,)) and ref.engine_of(9) is None


def test_sglang_engine_across_nodes_refused_in_one_line():
    """An SGLang engine whose group would cross a node boundary cannot start its schedulers on its ranks' GPUs."""
    from mtrain.trainer.decisions import decide
    # 3 nodes of 6 ranks, 6 training ranks: the second engine of TP4 would take ranks 10-13 on nodes 1 and 2
    cfg = load_config(CONFIG, ["model.hf_path=x", "engine.placement=separate", "engine.ranks=12", "engine.tp=4",
                               "engine.kind=sglang", "parallel.tp=2", "train.save_interval=-1"])
    with pytest.raises(ConfigError) as e:
        decide(cfg, world_size=18, local_world_size=6, cuda=True, te=False)
    assert "engine 1 (ranks [10, 11, 12, 13]) lies on two nodes" in str(e.value) and "\n" not in str(e.value)
    ok = load_config(CONFIG, ["model.hf_path=x", "engine.placement=separate", "engine.ranks=8", "engine.tp=4",
                              "engine.kind=sglang", "parallel.tp=2", "train.save_interval=-1"])
    assert decide(ok, world_size=16, local_world_size=8, cuda=True, te=False).groups.count == 2

