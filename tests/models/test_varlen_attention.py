"""Causal attention over a packed stream (mtrain/models/varlen_attention.py) against float64 math written here,
and the shape rule that made the packed path slow on the H200: torch's fused SDPA kernels refuse 3-D inputs."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtrain.models import varlen_attention
from mtrain.models.varlen_attention import causal_packed_attention, varlen_usable


def _reference(q, k, v, cu, scale):
    """float64, one sequence at a time, GQA by index arithmetic (no torch attention op)."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for h in range(q.shape[1]):
            s = q[a:b, h] @ k[a:b, h // groups].T * scale
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            out[a:b, h] = p @ v[a:b, h // groups]
    return out


@pytest.mark.parametrize("heads,kv_heads,scale", [(4, 4, None), (8, 2, None), (6, 3, 0.3)])
def test_matches_float64_reference_with_gqa_and_scale(heads, kv_heads, scale):
    g = torch.Generator().manual_seed(0)
    cu = [0, 5, 6, 19, 40]  # a one-token sequence among them
    d = 16
    q = torch.randn(cu[-1], heads, d, generator=g)
    k = torch.randn(cu[-1], kv_heads, d, generator=g)
    v = torch.randn(cu[-1], kv_heads, d, generator=g)
    scale = scale or d ** -0.5
    ins = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = causal_packed_attention(*ins, torch.tensor(cu, dtype=torch.int32), cu, 21, scale)
    ref_in = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = _reference(*ref_in, cu, scale)
    assert out.shape == (cu[-1], heads, d)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    for got, want in zip(ins, ref_in):  # GQA: each K/V head's gradient sums over its query heads
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)


def test_fused_kernels_need_4d_and_the_per_sequence_path_gives_them_4d():
    """The cause of issue 18's packed slowdown: 3-D [heads, L, d] slices cannot use a fused kernel (the old path
    fell back to the float32 math kernel on the GPU); the per-sequence path now runs under FLASH only."""
    x = torch.randn(4, 10, 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
    q = torch.randn(12, 4, 16)
    kv = torch.randn(12, 2, 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if any call of the path is not fused-eligible
        out = causal_packed_attention(q, kv, kv, torch.tensor([0, 7, 12], dtype=torch.int32), [0, 7, 12], 7, 0.25)
    torch.testing.assert_close(out.double(), _reference(q, kv, kv, [0, 7, 12], 0.25), atol=1e-5, rtol=1e-5)


def test_varlen_kernel_is_only_chosen_on_cuda_half_precision(monkeypatch):
    x = torch.randn(8, 2, 16)
    assert not varlen_usable(x, x, x)  # CPU float32: the per-sequence SDPA path
    assert not varlen_usable(x.bfloat16(), x.bfloat16(), x.bfloat16())  # CPU bf16 too (flash varlen is CUDA)
    if torch.cuda.is_available():
        y = x.cuda().bfloat16()
        monkeypatch.setenv("MTRAIN_VARLEN_ATTN", "0")
        assert not varlen_usable(y, y, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention runs on CUDA only")
def test_varlen_kernel_matches_reference_on_cuda():
    g = torch.Generator().manual_seed(1)
    cu = [0, 3, 130, 131, 400]
    q, k, v = (torch.randn(cu[-1], h, 64, generator=g).bfloat16().double() for h in (8, 2, 2))
    dev = [x.cuda().bfloat16().requires_grad_(True) for x in (q, k, v)]
    assert varlen_usable(*dev)
    out = causal_packed_attention(*dev, torch.tensor(cu, dtype=torch.int32, device="cuda"), cu, 269, 0.125)
    assert not varlen_attention.VARLEN_ERROR, varlen_attention.VARLEN_ERROR  # the varlen kernel ran, no fallback
    assert "varlen" in varlen_attention.PATHS_USED
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = _reference(*ref_in, cu, 0.125)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(grad.cuda().bfloat16())  # the trainer needs the kernel's backward (GQA: K/V grads summed)
    ref.backward(grad)
    for got, want in zip(dev, ref_in):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, atol=5e-2, rtol=5e-2)
