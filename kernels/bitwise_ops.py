"""Batch-invariant, fixed-order ops shared by the trainer's bitwise layers and the reference engine's bitwise forward.

Why: the trainer (Megatron layers) and the CPU reference engine (HF transformers) compute the same model with
different kernels, whose reduction orders depend on the kernel, the batch size and the number of rows; their
sampled-token logprobs then differ by ~1e-6 in float32. Here every op is written once, from elementwise IEEE
operations only (+, *, /, sqrt: exactly rounded, the same bits in any vector lane or tensor shape), so both sides
get the same bits whatever the batch, sequence length or tensor-parallel split:

- Every sum over a dimension is `tree_sum`: the dimension is zero-padded to a power of two and reduced by adding
  adjacent pairs, level by level. Trailing zeros never change the sum (x + 0 = x), so a sum over keys 0..t is the
  same for a 5-token prefix and a 500-token sequence; and a contiguous power-of-two shard of the dimension reduces to
  exactly one subtree, so a row-parallel layer whose ranks each hold a power-of-two slice of K, combined in rank
  order by the same tree, equals the single-rank sum (tensor parallelism: trainer TP2 = engine TP1).
- Arithmetic is float32 whatever the weights' dtype (bf16 inputs are upcast, the result is rounded back once).
- Transcendentals (exp, log, cos, sin) are evaluated in float64 and rounded to float32: torch's vectorized and
  scalar-tail paths can differ by an ulp in float32, while their float64 results round to the same float32.

Cost: a product tensor of [rows, N, K] per linear, so this is for correctness on small CPU models, not speed.

On CUDA tensors `linear`, `linear_fp32`, `rms_norm` and `token_logprobs` run the fixed-tile Triton kernels of
`bitwise_gpu.py` instead (tree sums of [rows, N, K] products do not fit a real model on a GPU); both sides then call
them on the same device, so they agree with each other, not with the CPU forms. Attention on a GPU is the engine's
paged kernel (bitwise_gpu.paged_attention, the trainer's through mtrain.models.bitwise_layers); the other ops are
elementwise or tree sums and give the same bits on a GPU whatever the shape.
"""
from __future__ import annotations

import functools

import torch


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in a fixed binary tree of adjacent pairs over the zero-padded power-of-two length."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = _next_pow2(n)
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def row_parallel_slice_problem(size: int, ranks: int) -> str | None:
    """Why `ranks` ranks, each holding a contiguous slice of a row-parallel layer's `size` inputs, cannot add up to
    the single-rank `tree_sum` bit for bit (None: they can): each slice must be a power of two, so that it is exactly
    one subtree of the fixed order. Read by the bitwise layer as it is built and by the launcher's early check."""
    local = size // ranks
    if ranks > 1 and local & (local - 1):
        return (f"a power-of-two input slice per rank of each row-parallel layer is needed (one subtree of the fixed "
                f"sum order); {size}/{ranks}={local} is not one")
    return None


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


ROW_BLOCK_ELEMENTS = 1 << 24  # float32 elements of one [rows, N, K] product block (64 MiB)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in float32 with a `tree_sum` over K: each output element depends on its own row
    and column only (batch-invariant), in blocks of rows to bound the product's memory. Differentiable."""
    if x.is_cuda:
        from .bitwise_gpu import linear_fp32 as gpu_linear_fp32
        return gpu_linear_fp32(x, weight)
    w = weight.float()
    n, k = w.shape
    flat = x.reshape(-1, k).float()
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, n * k))
    outs = [tree_sum(flat[i:i + rows, None, :] * w[None, :, :]) for i in range(0, flat.shape[0], rows)]
    out = torch.cat(outs) if outs else flat.new_zeros(0, n)
    return out.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_fp32` rounded to x's dtype, then + bias (in that dtype)."""
    if x.is_cuda:
        from .bitwise_gpu import linear as gpu_linear
        out = gpu_linear(x, weight)
    else:
        out = linear_fp32(x, weight).to(x.dtype)
    return out + bias if bias is not None else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, float32 inside, rounded to x's dtype."""
    if x.is_cuda:  # one kernel launch instead of a tree of them (bitwise_gpu)
        from .bitwise_gpu import rms_norm as gpu_rms_norm
        return gpu_rms_norm(x, weight, eps)
    xf = x.float()
    var = tree_sum(xf * xf) / xf.shape[-1]
    return (weight.float() * (xf / torch.sqrt(var + eps)[..., None])).to(x.dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, d: int, device: torch.device) -> torch.Tensor:
    """float64 RoPE frequencies, made on the CPU (the same bits on every device) and kept per device: no host-to-device
    copy inside a CUDA graph capture of the engine's decode step."""
    return (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).to(device)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (Llama/Qwen3, Megatron's non-interleaved layout) of x [T, H, D] at integer positions [T]."""
    d = x.shape[-1]
    ang = positions.to(torch.float64)[:, None] * _inv_freq(float(theta), d, positions.device)[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()  # [T, D/2]: small next to x
    if x.is_cuda:
        from .bitwise_gpu_elementwise import ELEMENTWISE, rope as gpu_rope
        if ELEMENTWISE == "fused":
            return gpu_rope(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's causal attention: q [T, H, D], k and v [T, Hkv, D] (grouped-query: H a multiple of Hkv);
    returns [T, H, D] in q's dtype. Scores, softmax and the weighted sum of values are tree sums; masked keys give
    exact zeros, so query t's result is the same for any sequence length >= t + 1."""
    t, h, d = q.shape
    rep = h // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    qf = q.float()
    # [H, Tq, Tk]
    scores = tree_sum(qf.permute(1, 0, 2)[:, :, None, :] * kf.permute(1, 0, 2)[:, None, :, :]) * scale
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # a max is exact in any order
    e = exp(scores - m)
    p = e / tree_sum(e)[..., None]
    # out[h, i, :] = sum_j p[h, i, j] * v[j, h, :]
    out = tree_sum(p[:, :, None, :] * vf.permute(1, 2, 0)[:, None, :, :])  # [H, Tq, D]
    return out.permute(1, 0, 2).to(q.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU MLP's activation), float64 silu rounded to float32, result in gate's dtype. On CUDA:
    one launch in float32 (bitwise_gpu_elementwise), which both sides run."""
    if gate.is_cuda:
        from .bitwise_gpu_elementwise import ELEMENTWISE, silu_mul as gpu_silu_mul
        if ELEMENTWISE == "fused":
            return gpu_silu_mul(gate, up)
    g = gate.double()
    silu = (g / (1.0 + torch.exp(-g))).float()
    return (silu * up.float()).to(gate.dtype)


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 log_softmax(logits / T)[target] over the last dimension (the full vocabulary), fixed order.
    logits [..., V], target [...] -> [...]. Differentiable. On CUDA: SGLang's sampler's formula (bitwise_gpu)."""
    if logits.is_cuda:
        from .bitwise_gpu import token_logprobs as sampler_logprobs
        return sampler_logprobs(logits, target, temperature)
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    z = x - x.amax(dim=-1, keepdim=True).detach()
    lse = log(tree_sum(exp(z)))
    return z.gather(-1, target.long()[..., None]).squeeze(-1) - lse
