"""engine.offload_train picks only what it can and should move: the storages on the parameters' device that it can
free. With `optim.cpu_offload` megatron-core keeps the optimizer state on the host in pinned (not resizable)
memory: on 2 x H200 offloading such a storage raised "Trying to resize storage that is not resizable" (2026-11-30).
The integration test (the whole loop, bytes moved, nothing changed) is tests/trainer/test_pool_loop.py; this one
holds the selection rules on a real torch optimizer's state."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from mtrain.trainer.learner.offload import TrainOffload, _storages


def _actor():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    chunk = SimpleNamespace(parameters=model.parameters, buffers=[])  # what the actor's DDP chunks offer here
    return SimpleNamespace(chunks=[chunk], optimizer=opt), model, opt


def test_offload_moves_device_state_and_leaves_host_owned_and_other_device_state():
    actor, model, opt = _actor()
    state = opt.state[model.weight]
    state["host_owned"] = torch.from_numpy(np.arange(6, dtype=np.float32))  # memory numpy owns: not resizable
    state["elsewhere"] = torch.empty(5, device="meta")  # not on the parameters' device: already off it
    picked = _storages(actor)
    assert all(t.device == model.weight.device for t in picked)
    assert not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                   for t in picked for p in model.parameters())  # parameters stay (pull sync reads them)

    before = {k: v.clone() for k, v in state.items() if k != "elsewhere"}
    movable = sum(t.untyped_storage().nbytes() for t in picked if t.untyped_storage().resizable())
    off = TrainOffload(actor, enabled=True)
    m = off.offload()
    assert m["offload/bytes"] == movable > 0
    assert m["offload/kept_bytes"] == 6 * 4
    assert state["exp_avg"].untyped_storage().nbytes() == 0  # really freed
    assert state["host_owned"].untyped_storage().nbytes() == 24  # left in place, unharmed
    r = off.reload()
    assert r["reload/bytes"] == m["offload/bytes"]
    for k, v in before.items():
        assert torch.equal(state[k], v), k
