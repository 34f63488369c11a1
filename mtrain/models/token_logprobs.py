"""Logprob of the sampled token under softmax(logits / T), in row chunks: never [tokens x vocab] in float32.

The plain way (`logits.float() / T`, mask, `vocab_parallel_cross_entropy`) makes several float32 copies of the
whole [tokens x vocab] logits: at a 16,384-token micro-batch and Qwen3's 151,936-entry vocabulary each copy is
10 GB, and Megatron's cross entropy keeps one more for its backward. Here the logits stay in the model's dtype;
each chunk of rows is upcast, reduced to its log-sum-exp and the target's logit, and dropped. The backward
recomputes the softmax chunk by chunk from the saved (model-dtype) logits and writes the gradient in that dtype,
so the extra memory is a few chunk-sized float32 buffers (`chunk_bytes`, default 256 MiB) and [tokens] floats.

Vocabulary-parallel: with tensor parallelism each rank holds columns [vocab_start, vocab_start + local) of the
logits. Each rank reduces its shard to a per-row log-sum-exp; the global one is combined over `group` (a max and a
sum of [tokens] floats, not per chunk), and the target's logit comes from the rank that holds it (a sum). Columns
at or past `vocab` (Megatron's padding of the vocabulary to a multiple of 128 x TP) are left out: they do not exist
in HF or SGLang. The backward needs no communication (the gradient of a rank's columns is local).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_BYTES = 256 << 20  # float32 bytes of one chunk of rows
def _bitwise(logits, target, vocab, temperature, group):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from mtrain.kernels.bitwise_ops import token_logprobs as fixed_order
    if group is not None and dist.get_world_size(group) > 1:
        logits = gather_from_tensor_model_parallel_region(logits.contiguous(), group=group)
    return fixed_order(logits[..., :vocab], target, temperature)


def _rows(n_rows: int, local_vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(local_vocab, 1)))


def _blocks(logits: torch.Tensor, rows: int):
    """(batch index, row slice) covering a [B, S, V] tensor in chunks of at most `rows` rows, any strides."""
    for b in range(logits.shape[0]):
        for s in range(0, logits.shape[1], rows):
            yield b, slice(s, min(s + rows, logits.shape[1]))


def _scaled(chunk: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    """float32 chunk / T with the padding columns (index >= valid) at -inf."""
    x = chunk.float()
    if temperature != 1.0:
        x = x / temperature
    if valid < x.shape[-1]:
        if x.data_ptr() == chunk.data_ptr():  # float32 logits at T = 1: `x` is the caller's tensor
            x = x.clone()
        x[..., valid:] = float("-inf")
    return x


def _combine_lse(lse: torch.Tensor, group) -> torch.Tensor:
    """log(sum over ranks of exp(lse_rank)), row-wise."""
    if group is None or dist.get_world_size(group) == 1:
        return lse
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(lse - m)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    return m + torch.log(s)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab, temperature, vocab_start, group, chunk_bytes):
        b, s, local = logits.shape
        valid = max(0, min(local, vocab - vocab_start))  # this rank's real (non-padding) columns
        rows = _rows(b * s, local, chunk_bytes)
        lse = torch.empty((b, s), dtype=torch.float32, device=logits.device)
        picked = torch.zeros((b, s), dtype=torch.float32, device=logits.device)
        idx = target.long() - vocab_start
        mine = (idx >= 0) & (idx < valid)
        safe = torch.where(mine, idx, torch.zeros_like(idx))
        for i, sl in _blocks(logits, rows):
            x = _scaled(logits[i, sl], temperature, valid)
            lse[i, sl] = torch.logsumexp(x, dim=-1)
            picked[i, sl] = torch.where(mine[i, sl], x.gather(-1, safe[i, sl, None]).squeeze(-1), 0.0)
            del x
        lse = _combine_lse(lse, group)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(logits, lse, safe, mine)
        ctx.args = (temperature, valid, rows)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, safe, mine = ctx.saved_tensors
        temperature, valid, rows = ctx.args
        grad = torch.empty_like(logits)
        g = grad_out.float() / temperature
        for i, sl in _blocks(logits, rows):
            # d logprob / d logit_j = (1[j = target] - softmax_j) / T
            p = torch.exp(_scaled(logits[i, sl], temperature, valid) - lse[i, sl, None])
            p.mul_(-g[i, sl, None])
            p.scatter_add_(-1, safe[i, sl, None], torch.where(mine[i, sl], g[i, sl], 0.0)[:, None])
            grad[i, sl] = p.to(grad.dtype)
            del p
        return grad, None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab: int, temperature: float = 1.0,
                   vocab_start: int = 0, group=None, chunk_bytes: int | None = None, bitwise: bool = False
                   ) -> torch.Tensor:
    """float32 logprob of `target` at every position: logits [B, S, local vocab] (any dtype, any strides; this
    rank's columns from `vocab_start`), target [B, S] of global token ids; also [S, V] / [S]. Differentiable.
    chunk_bytes: float32 bytes per chunk of rows (default: the module's CHUNK_BYTES, read at each call).
    bitwise: the logits are a bitwise model's (numerics.on_policy=bitwise): the logprobs come from the full
    vocabulary by the fixed-order log-softmax the engine also uses (mtrain.kernels.bitwise_ops,
    docs/design-on-policy.md)."""
    squeeze = logits.dim() == 2
    if squeeze:
        logits, target = logits.unsqueeze(0), target.unsqueeze(0)
    if logits.dim() != 3 or target.shape != logits.shape[:2]:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} and target {tuple(target.shape)} do not "
                         f"match ([B, S, V] and [B, S])")
    if bitwise:
        out = _bitwise(logits, target, vocab, max(float(temperature), 1e-6), group)
        return out[0] if squeeze else out
    out = _TokenLogprobs.apply(logits, target, vocab, max(float(temperature), 1e-6), vocab_start, group,
                               CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    return out[0] if squeeze else out
