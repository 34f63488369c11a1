"""Where a weight sync writes inside an engine: the parameter names it addresses and their checks, engine-neutral.

A destination is an engine parameter by its own name, `p` (the whole per-rank parameter) or `p@a:b` (rows [a, b)
along dim 0: local experts of a fused MoE weight, or one piece of a tensor too big for one bucket). Both the push
loader (`mtrain.rollout.sglang_loader`, run inside SGLang's schedulers) and the pull protocol (`pull_protocol`)
resolve names here, so the two modes refuse the same things with the same LoaderError messages.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from mtrain.kernels import BlockFp8
from mtrain.kernels.fp8 import FP8
from mtrain.layouts.fp8 import BLOCK, CHANNEL_SCALE_SUFFIX, REQUANTIZED_MARK, SCALE_SUFFIX

_TARGET_RE = re.compile(r"^(?P<param>[^@]+?)(?:@(?P<start>\d+):(?P<stop>\d+))?$")


class LoaderError(ValueError):
    """A bucket does not fit the engine's parameters; the message names the parameter."""


@dataclass(frozen=True)
class Target:
    param: str
    start: int | None = None  # row range along dim 0; None = the whole parameter
    stop: int | None = None

    def __str__(self) -> str:
        return self.param if self.start is None else f"{self.param}@{self.start}:{self.stop}"


def parse_target(name: str) -> Target:
    """'p' -> whole parameter p; 'p@a:b' -> rows [a, b) of p along dim 0."""
    if not isinstance(name, str):
        raise LoaderError(f"tensor name must be a str, got {type(name).__name__}: {name!r}")
    m = _TARGET_RE.match(name)
    if m is None:
        raise LoaderError(f"bad tensor name {name!r}: expected '<param>' or '<param>@<start>:<stop>'")
    if m["start"] is None:
        return Target(m["param"])
    start, stop = int(m["start"]), int(m["stop"])
    if stop <= start:
        raise LoaderError(f"bad row range in {name!r}: stop {stop} must exceed start {start}")
    return Target(m["param"], start, stop)


def unknown_param(name: str, params: Mapping[str, torch.Tensor]) -> LoaderError:
    close = difflib.get_close_matches(name, list(params), n=3)
    hint = f"; closest: {close}" if close else ""
    return LoaderError(f"engine has no parameter {name!r} ({len(params)} parameters){hint}")


def target_view(params: Mapping[str, torch.Tensor], name: str) -> tuple[Target, torch.Tensor, tuple[int, int]]:
    """The part of a parameter `name` addresses ('p', or rows 'p@a:b'): (target, view, row span).
    Raises LoaderError for a bad name, an unknown parameter or rows out of range."""
    target = parse_target(name)
    param = params.get(target.param)
    if param is None:
        raise unknown_param(target.param, params)
    rows = param.shape[0] if param.dim() > 0 else 1
    if target.start is None:
        return target, param.data, (0, rows)
    if param.dim() == 0:
        raise LoaderError(f"{name}: row range on a 0-d parameter {target.param}")
    if target.stop > rows:
        raise LoaderError(f"{name}: rows [{target.start}, {target.stop}) out of range for "
                          f"{target.param} with {rows} rows (shape {tuple(param.shape)})")
    return target, param.data[target.start:target.stop], (target.start, target.stop)


def synchronize(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the work queued on the GPUs these tensors live on. The loaders' sources are the trainer's memory
    (CUDA IPC): the trainer may change it as soon as the call returns, so the copies must have run by then."""
    for d in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(d)


def fp8_storage(view: torch.Tensor, scaling: str) -> torch.Tensor:
    """The [N, K] tensor the sync writes for an FP8 parameter: the parameter itself (block), or the storage of
    SGLang's per-channel `weight`, a [K, N] transposed view of contiguous [N, K] bytes (layouts/fp8.py)."""
    if scaling != "channel":
        return view
    if view.dim() != 2 or not view.t().is_contiguous():
        raise LoaderError(f"a per-channel FP8 weight is SGLang's [K, N] transposed view of [N, K] storage; this "
                          f"engine's has shape {tuple(view.shape)} and strides {tuple(view.stride())} (a block-FP8 "
                          "engine's layout? the plan and the engine disagree on engine.fp8_scaling)")
    return view.t()


def own_fp8_spec(params: Mapping[str, torch.Tensor], name: str) -> BlockFp8:
    """The FP8 format parameter `name` has in this engine, by the scale it holds (push: the bucket carries the
    trainer's dtype and the engine's own layout decides): `weight_scale_inv` block, `weight_scale` per-channel."""
    if name + SCALE_SUFFIX not in params and name + CHANNEL_SCALE_SUFFIX in params:
        view = params[name].data
        return fp8_spec(params, name, name + CHANNEL_SCALE_SUFFIX, None, [1, int(view.shape[0])], "channel")
    return fp8_spec(params, name, name + SCALE_SUFFIX, None, list(BLOCK))


def fp8_spec(params: Mapping[str, torch.Tensor], name: str, scale_name: str, scale_shape: Sequence[int] | None,
             block: Sequence[int], scaling: str = "block") -> BlockFp8:
    """The engine's FP8 parameter `name` and its scale `scale_name`, checked (shape None: the weight's grid, or
    per-channel [1, N])."""
    target, view, _ = target_view(params, name)
    if target.start is not None:
        raise LoaderError(f"{name}: an FP8 target must be a whole parameter")
    if scaling not in ("block", "channel"):
        raise LoaderError(f"{name}: bad FP8 scaling {scaling!r}: expected block or channel")
    if view.dtype != FP8:
        raise LoaderError(f"{name}: the trainer quantizes it to FP8 but this engine holds it as {view.dtype}: start "
                          "the engine with quantization fp8, or set engine.weight_dtype=auto")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise LoaderError(f"{name}: bad FP8 block {block!r}: expected two positive ints")
    scale = params.get(scale_name)
    if scale is None:
        raise LoaderError(f"{name} is float8_e4m3fn but the engine has no parameter {scale_name!r} (a block-FP8 "
                          "engine has one per FP8 weight, a per-channel engine weight_scale: engine.fp8_scaling and the "
                          "engine disagree)")
    view = fp8_storage(view, scaling)  # FP8 here (checked above): per-channel, the [N, K] storage of SGLang's view
    if scaling == "channel" and (view.dim() != 2 or list(block) != [1, view.shape[1]]):
        raise LoaderError(f"{name}: per-channel FP8 block {list(block)} does not fit the engine's weight storage "
                          f"{tuple(view.shape)} (expected [1, {view.shape[-1]}])")
    want = [-(-view.shape[-2] // block[0]), -(-view.shape[-1] // block[1])]
    want = list(view.shape[:-2]) + want if scale_shape is None else list(scale_shape)
    if scale_shape is None and scaling == "channel":
        want = [1, int(view.shape[0])]  # SGLang's weight_scale.t(): one scale per output row
    if scale.dtype != torch.float32 or list(scale.shape) != want or not scale.is_contiguous():
        raise LoaderError(f"{scale_name}: expected a contiguous float32 {tuple(want)} scale ({block[0]}x{block[1]} "
                          f"blocks), the engine has {scale.dtype} {tuple(scale.shape)}")
    if getattr(scale, REQUANTIZED_MARK, False):
        raise LoaderError(f"{scale_name}: SGLang requantized this layer's scales to UE8M0 for DeepGEMM after loading "
                          "(DeepGEMM on Blackwell, or forced); mtrain writes amax/448 float32 scales: run the FP8 "
                          "engine on Hopper with fp8_gemm_runner_backend=triton (docs/fp8.md)")
    if not view.is_contiguous():
        raise LoaderError(f"{name}: the engine's FP8 parameter is not contiguous")
    return BlockFp8(scale.data.view(-1), tuple(view.shape), (int(block[0]), int(block[1])), scaling)
