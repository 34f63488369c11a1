"""The chunked sampled-token logprob (mtrain/models/token_logprobs.py) against float64 math written from the
formula: log softmax(logits / T)[target], padding columns left out; its gradient against float64 autograd; the
vocabulary split over two gloo ranks as tensor parallelism splits it; and that no float32 [tokens x vocab] tensor
is ever made (the slow, memory-hungry scoring pass made several)."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from mtrain.models.token_logprobs import token_logprobs


def reference(logits: torch.Tensor, target: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """float64: log(exp(z_t) / sum_{j < vocab} exp(z_j)), z = logits / T."""
    z = logits.double()[..., :vocab] / temperature
    return z.gather(-1, target[..., None]).squeeze(-1) - torch.log(torch.exp(z - z.max(-1, keepdim=True).values)
                                                                    .sum(-1)) - z.max(-1).values


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, 1.0), (torch.float32, 0.7), (torch.float32, 1.0)])
def test_forward_and_backward_against_float64(dtype, temperature):
    g = torch.Generator().manual_seed(int(temperature * 10) + (dtype == torch.bfloat16))
    b, s, padded, vocab = 3, 37, 515, 500  # 15 padding columns, as Megatron pads the vocabulary
    full = (torch.randn(b, s + 1, padded, generator=g) * 3).to(dtype).requires_grad_()
    logits = full[:, :-1]  # not contiguous for b > 1: as the actor slices the model's output
    target = torch.randint(0, vocab, (b, s), generator=g)
    weights = torch.randn(b, s, generator=g)
    # chunks of 7 rows: several chunks per row of the batch, the last one short
    lp = token_logprobs(logits, target, vocab, temperature, chunk_bytes=7 * padded * 4)
    assert lp.dtype == torch.float32 and lp.shape == (b, s)
    ref_in = full.detach().double().requires_grad_()
    ref = reference(ref_in[:, :-1], target, vocab, temperature)
    assert rel(lp, ref) < 1e-6  # float32 arithmetic on the same (model-dtype) inputs
    (lp * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient is written in the logits' dtype
    assert rel(full.grad, ref_in.grad) < tol
    assert full.grad[:, :, vocab:].abs().max() == 0  # padding columns get no gradient
    assert full.grad[:, -1].abs().max() == 0


def test_no_grad_and_two_dim_input():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 300, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 300, (64,), generator=g)
    with torch.no_grad():
        lp = token_logprobs(logits, target, 300, 1.0, chunk_bytes=10 * 300 * 4)
    assert lp.shape == (64,)
    assert rel(lp, reference(logits, target, 300, 1.0)) < 1e-6
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, target[:10], 300)


def test_float32_logits_are_not_modified():
    """Masking the padding columns of float32 logits at T = 1 must not write -inf into the caller's tensor."""
    logits = torch.randn(2, 5, 40)
    before = logits.clone()
    token_logprobs(logits, torch.zeros(2, 5, dtype=torch.long), 30, 1.0)
    assert torch.equal(logits, before)


class LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_never_holds_tokens_by_vocab_in_float32():
    tokens, vocab = 512, 4096
    logits = torch.randn(1, tokens, vocab).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (1, tokens))
    chunk = 64 * vocab * 4
    with LargestFloat32() as seen:
        lp = token_logprobs(logits, target, vocab, 0.9, chunk_bytes=chunk)
        lp.sum().backward()
    assert seen.largest <= 64 * vocab  # one chunk of rows, never [tokens x vocab]
    # the plain way (upcast, divide, softmax) makes [tokens x vocab] float32 tensors: the mode would see them
    with LargestFloat32() as plain:
        torch.log_softmax(logits.float() / 0.9, -1)
    assert plain.largest == tokens * vocab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, full: torch.Tensor, target, vocab: int, weights, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = full.shape[-1] // world
        shard = full[..., rank * local:(rank + 1) * local].clone().requires_grad_()
        lp = token_logprobs(shard, target, vocab, 0.8, vocab_start=rank * local, group=dist.group.WORLD,
                           chunk_bytes=5 * local * 4)
        (lp * weights).sum().backward()
        queue.put((rank, lp.detach(), shard.grad))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_ranks():
    """Two ranks, each with half the columns (the second holding the padding), as Megatron's TP splits the head."""
    g = torch.Generator().manual_seed(11)
    b, s, padded, vocab = 2, 13, 256, 243
    full = (torch.randn(b, s, padded, generator=g) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (b, s), generator=g)
    weights = torch.randn(b, s, generator=g)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, full, target, vocab, weights, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (lp, gr)) for r, lp, gr in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref_in = full.double().requires_grad_()
    ref = reference(ref_in, target, vocab, 0.8)
    (ref * weights.double()).sum().backward()
    for r in range(2):
        assert rel(got[r][0], ref) < 1e-6  # every rank returns the whole logprob
    grad = torch.cat([got[0][1], got[1][1]], dim=-1)
    assert rel(grad, ref_in.grad) < 1e-2  # bf16 gradient
    assert grad[..., vocab:].abs().max() == 0


def _actor_worker(port: int, queue) -> None:
    """The actor's own call site, as the scoring pass and the loss call it (one rank, megatron-core's groups)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import mtrain.models.token_logprobs as chunked
    from mtrain.dist import init_distributed
    from mtrain.trainer.learner.actor import token_logprobs as actor_token_logprobs
    init_distributed(seed=1)
    tokens, vocab = 256, 2048
    chunked.CHUNK_BYTES = 32 * vocab * 4  # chunks of 32 rows at this small size (256 MiB at a real one)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, tokens, vocab, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    with LargestFloat32() as seen:
        lp = actor_token_logprobs(logits, ids, vocab, 1.0)
        lp.sum().backward()
    queue.put((seen.largest, rel(lp, reference(logits[:, :-1], ids[:, 1:], vocab, 1.0)), tokens * vocab))
    dist.destroy_process_group()


def test_actor_scoring_never_holds_tokens_by_vocab_in_float32():
    """Before the chunked logprob the actor upcast the whole [tokens x vocab] logits (several float32 copies, 10 GB
    each for a 16k-token micro-batch of Qwen3's vocabulary): this failed then."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_actor_worker, args=(_free_port(), queue))
    p.start()
    largest, err, full = queue.get(timeout=180)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert err < 1e-6
    assert largest < full // 4, f"a float32 tensor of {largest} elements (the whole logits: {full})"
