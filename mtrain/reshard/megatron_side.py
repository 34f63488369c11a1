"""The Megatron end of resharding inside a live job: this rank's tensors, the current layout, HF loading.

Source and destination tensors are looked up by the names the layout tables give (local spec or TE),
in this rank's model chunks: parameters and the buffers that are weights (the router's expert_bias).
"""
from __future__ import annotations

from typing import Callable

import torch

from mtrain.layouts.table import ModelLayout
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import HFLayout, MegatronLayout
from mtrain.reshard.planner import Plan, TensorRef, build_plan


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def chunk_tensors(chunks: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    out = []
    for c in chunks:
        m = unwrap(c)
        d = dict(m.named_parameters())
        d.update({n: b for n, b in m.named_buffers() if n.endswith("expert_bias")})
        out.append(d)
    return out


def tensor_lookup(chunks: list[torch.nn.Module]) -> Callable[[TensorRef], torch.Tensor]:
    tables = chunk_tensors(chunks)

    def get(ref: TensorRef) -> torch.Tensor:
        try:
            return tables[ref.chunk][ref.name]
        except KeyError:
            raise KeyError(f"Megatron model chunk {ref.chunk} on this rank has no tensor {ref.name!r} "
                           f"(the layout table and the built model disagree)") from None
    return get


def current_layout(first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> MegatronLayout:
    """The MegatronLayout of the running job, read from megatron's parallel_state (plus the uneven pipeline
    split the model was built with, which parallel_state does not know)."""
    from megatron.core import parallel_state as ps
    return MegatronLayout(first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                          tp=ps.get_tensor_model_parallel_world_size(),
                          pp=ps.get_pipeline_model_parallel_world_size(),
                          vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                          ep=ps.get_expert_model_parallel_world_size(),
                          etp=ps.get_expert_tensor_parallel_world_size(),
                          cp=ps.get_context_parallel_world_size(),
                          dp=ps.get_data_parallel_world_size())


def check_complete(plan: Plan, rank: int, chunks) -> None:
    """Every parameter of this rank's model is named by the plan's table, and every named one exists."""
    expected = {(k[1], k[2]) for k in plan.dst_tensors if k[0] == rank}
    actual = {(ci, n) for ci, t in enumerate(chunk_tensors(chunks)) for n in t}
    missing, extra = expected - actual, actual - expected
    if missing or extra:
        raise KeyError(f"layout table vs built model on rank {rank}: table names not in the model "
                       f"{sorted(missing)[:5]}, model tensors the table does not name {sorted(extra)[:5]}")


def load_hf_into_megatron(model: ModelLayout, chunks, hf_get: Callable[[str], torch.Tensor], rank: int,
                          layout: MegatronLayout | None = None, backend: str = "torch") -> None:
    """Fill this rank's chunks from HF tensors (`hf_get(name)`); every rank reads the files itself."""
    plan = build_plan(model, HFLayout(), layout or current_layout())
    check_complete(plan, rank, chunks)
    dst = tensor_lookup(chunks)
    device = next(unwrap(chunks[0]).parameters()).device  # the files are read to the host: move each tensor
    with torch.no_grad():
        Executor(plan, rank, lambda ref: hf_get(ref.name).to(device), dtype=torch.float32, src_everywhere=True,
                 backend=backend, device=device).write_into(lambda ref: dst(ref).data)
