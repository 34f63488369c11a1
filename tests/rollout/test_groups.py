"""Engine groups: which ranks form which engine, who leads, who owns each engine rank, and the SGLang arguments that
place an engine, including one spanning nodes (SGLang's nnodes / node_rank / dist_init_addr). Pure arithmetic,
checked against layouts written out by hand."""
import pytest

from mtrain.rollout.groups import EngineGroups, EngineLayoutError


def test_single_node_groups():
    g = EngineGroups(world_size=8, tp=2, local_world_size=8)
    assert g.count == 4
    assert [g.ranks(i) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [g.leader(i) for i in range(4)] == [0, 2, 4, 6]
    assert [g.group_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [g.owner(1, r) for r in range(2)] == [2, 3]  # engine 1's TP rank r lives on rank 2 + r's GPU
    assert [g.starts_engine_part(r) for r in range(8)] == [True, False] * 4
    assert g.sglang_placement(2, local_rank=2) == {"tp_size": 2, "base_gpu_id": 2}
    with pytest.raises(EngineLayoutError, match="rank 3 starts no engine part"):
        g.sglang_placement(3, local_rank=3)
    assert "engines: 4" in g.describe()


def test_engine_spanning_two_nodes():
    # 4 nodes of 8 ranks, engines of TP16 over 2 nodes: 2 engines; each further node's first rank starts a part.
    g = EngineGroups(world_size=32, tp=16, local_world_size=8, nnodes=2)
    assert g.count == 2 and g.ranks(1) == list(range(16, 32))
    assert [r for r in range(32) if g.starts_engine_part(r)] == [0, 8, 16, 24]
    assert [r for r in range(32) if g.is_leader(r)] == [0, 16]
    assert [g.node_rank(r) for r in (0, 7, 8, 15, 16, 24, 31)] == [0, 0, 1, 1, 0, 1, 1]
    assert g.sglang_placement(24, local_rank=0, dist_init_addr="node2:29501") == {
        "tp_size": 16, "base_gpu_id": 0, "nnodes": 2, "node_rank": 1, "dist_init_addr": "node2:29501"}
    with pytest.raises(EngineLayoutError, match="needs a rendezvous address"):
        g.sglang_placement(8, local_rank=0)
    assert g.owner(1, 9) == 25  # engine 1's TP rank 9 is on the second node of its group


@pytest.mark.parametrize("args,message", [
    (dict(world_size=4, tp=3, local_world_size=4), "engine.tp=3 does not divide the 4 ranks"),
    (dict(world_size=8, tp=8, local_world_size=4), "would straddle two nodes; set engine.nnodes"),
    (dict(world_size=8, tp=4, local_world_size=4, nnodes=2), "engine.tp must be 8, got 4"),
    (dict(world_size=24, tp=16, local_world_size=8, nnodes=2), "engine.tp=16 does not divide the 24 ranks"),
    (dict(world_size=4, tp=0, local_world_size=4), "engine.tp must be an int >= 1"),
])
def test_bad_layouts(args, message):
    with pytest.raises(EngineLayoutError, match=message):
        EngineGroups(**args)
