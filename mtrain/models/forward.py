"""Forward-only logits through Megatron's pipeline schedules (works for PP and VPP, TP and EP).

``forward_logits(chunks, tokens)`` returns full-vocabulary float logits ``[b, s, vocab]`` on the last
pipeline stage (the unpadded HF vocabulary) and ``None`` on other stages.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


@contextlib.contextmanager
def _main_head_only(chunks: list) -> Iterator[None]:
    """Skip the MTP heads for this forward: they only produce a training loss and need labels.

    GPTModel runs its MTP block when ``mtp_process`` is set, and then *requires* labels (it computes the
    MTP loss and returns a loss instead of logits). Logits of the main head do not depend on MTP, so we
    switch MTP off on our own model objects for the duration of the call and restore it afterwards.
    """
    saved = [(m, m.mtp_process) for m in chunks]
    config = chunks[0].config
    saved_layers = config.mtp_num_layers
    try:
        for m in chunks:
            m.mtp_process = False
        config.mtp_num_layers = None
        yield
    finally:
        config.mtp_num_layers = saved_layers
        for m, flag in saved:
            m.mtp_process = flag


def _multiple(n: int, k: int) -> int:
    return -(-n // k) * k


@torch.no_grad()
def forward_logits(
    chunks: list, tokens: torch.Tensor, *, micro_batch_size: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None, images: Optional[dict] = None,
) -> Optional[torch.Tensor]:
    """Run ``tokens [b, s]`` through the model chunks; full logits ``[b, s, vocab]`` (float32) on the last
    PP stage, ``None`` elsewhere. Every rank of the model-parallel group must call it with the same tokens.

    Rows are split into micro-batches of ``micro_batch_size`` (default: one micro-batch, or 1 row each with
    virtual pipelining, whose schedule needs a multiple of PP micro-batches; extra rows are padding copies).
    The sequence is padded at the end to a multiple of TP when sequence parallel is on (causal attention:
    padding after a position cannot change its logits) and cut back afterwards.

    A vision-language model: ``position_ids`` [3, b, s] (MRoPE, mtrain.models.mrope) and ``images`` =
    {"pixel_values", "image_grid_thw"} of all rows, in order; the rows then run as one micro-batch.
    """
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an integer tensor [batch, seq], got {tuple(tokens.shape)} {tokens.dtype}")
    config = chunks[0].config
    vocab = chunks[0].mtrain_vocab_size
    device = next(chunks[0].parameters()).device
    b, s = tokens.shape
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = len(chunks) if len(chunks) > 1 else None

    seq = _multiple(s, tp) if config.sequence_parallel else s
    if images is not None or position_ids is not None:
        if vpp or (micro_batch_size and micro_batch_size != b):
            raise ValueError("forward_logits with images or MRoPE position ids runs all rows as one micro-batch "
                             "(no virtual pipeline, micro_batch_size = rows)")
        micro_batch_size = b
    if vpp:
        mbs = micro_batch_size or 1
        n_micro = _multiple(_multiple(b, mbs) // mbs, pp)
    else:
        mbs = micro_batch_size or b
        n_micro = _multiple(b, mbs) // mbs
    rows = n_micro * mbs
    padded = torch.zeros(rows, seq, dtype=torch.long, device=device)
    padded[:b, :s] = tokens.to(device)
    if rows > b:
        padded[b:] = padded[0]
    if position_ids is None:
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq).contiguous()
    else:  # [3, b, s]: continue each row's positions over the sequence-parallel padding
        extra = seq - s
        tail = position_ids[..., -1:] + torch.arange(1, extra + 1) if extra else position_ids[..., :0]
        position_ids = torch.cat([position_ids, tail], dim=-1).to(device)
    model_kwargs = {k: v.to(device) for k, v in (images or {}).items()}
    micro_batches = [padded[i * mbs : (i + 1) * mbs] for i in range(n_micro)]
    # Each virtual stage walks all micro-batches through its own iterator.
    iterators = [iter(micro_batches) for _ in chunks]

    def step(data_iterator, model):
        micro = next(data_iterator)
        return model(micro, position_ids, attention_mask=None, **model_kwargs), None

    for m in chunks:
        m.eval()
    with _main_head_only(chunks):
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if vpp else iterators[0],
            model=chunks if vpp else chunks[0],
            num_microbatches=n_micro,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=True,
        )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    # [mbs, seq, V/tp] per micro-batch -> gather the vocabulary shards of the TP group.
    full = [gather_from_tensor_model_parallel_region(o.float()) for o in outputs]
    return torch.cat(full, dim=0)[:b, :s, :vocab].contiguous()
