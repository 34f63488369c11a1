"""Let megatron-core run where torch sees no GPU (tests, CI, the CPU reference loop).

Megatron-core assumes CUDA everywhere: it allocates with ``device=torch.cuda.current_device()`` or
``device="cuda"``, moves tensors with ``.cuda()``, keeps its dropout/init RNG streams in CUDA generators,
synchronises streams and records events, and checks ``param.type() == "torch.cuda.FloatTensor"``.
On a CPU build each of those raises "Torch not compiled with CUDA enabled" (a CUDA build with no GPU: "Found no
NVIDIA driver").

``apply()`` redirects exactly those calls to the CPU. It is idempotent, does nothing when CUDA is
available (so it can be called unconditionally), and touches no Megatron source: only attributes of
``torch.cuda`` and one name that Megatron imported *from* ``torch.cuda`` (``_lazy_call``), plus a
torch-function mode that rewrites CUDA device arguments. Every redirect below says why it is needed.

Megatron-level traps that are not ``torch.cuda`` calls live elsewhere, where they belong:
- MLA core attention on the local spec needs k_channels/v_channels: ``mtrain.models.specs``
  (a DotProductAttention subclass handed to the layer spec).
- PP with VPP on gloo silently swaps tensors with batched p2p: ``batch_p2p_comm=False`` on CPU in
  ``mtrain.models.builder``.
- MoE token splits: mtrain uses the alltoall dispatcher (variable-length sequences need it); the
  split sizes it passes to all_to_all_single are fixed up below. Gloo's all-gather needs equal sizes:
  forward on TP2xEP2 (ETP 1 and 2) did not hit it; a training path that all-gathers uneven token
  counts would need padding there.
- Dist checkpointing imports ``psutil`` and starts worker processes: scripts that save/load need an
  ``if __name__ == "__main__":`` guard (spawn re-imports the main module).
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

_all_to_all_single = torch.distributed.all_to_all_single
_applied = False
_lock = threading.Lock()
_CPU = torch.device("cpu")


def _is_cuda_device(device: object) -> bool:
    """A device argument Megatron meant as 'the current GPU': an int index, 'cuda[:i]', or torch.device('cuda')."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call.

    Megatron passes ``device=torch.cuda.current_device()`` (an int, which torch reads as cuda:N) or
    ``device="cuda"`` to factory functions (``torch.empty/zeros/ones/arange/tensor``) and to
    ``Tensor.to``, and calls ``Tensor.cuda()``. A torch-function mode sees all of these (it is how
    ``with torch.device(...)`` works), so one small class covers ~200 call sites without touching them.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        # Tensor.cuda() / Tensor.cuda(device): the tensor is already where it can live.
        if func is torch.Tensor.cuda:
            return args[0]
        # Megatron's optimizers compare param.type() with 'torch.cuda.FloatTensor' etc. to pick the
        # fp32-master path; report the CUDA type name so the CPU tensor takes the same branch.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        # MoE alltoall dispatcher: on GPU, maybe_move_tensor_to_cpu turns the split sizes into host numpy
        # arrays; it only acts on CUDA tensors, so on CPU they stay tensors, which c10d's binding rejects.
        if func is _all_to_all_single:
            for key in ("output_split_sizes", "input_split_sizes"):
                if isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = kwargs[key].tolist()
        # torch.device(torch.cuda.current_device()) / torch.device("cuda"), e.g. `with torch.device(...)`.
        if func is torch.device and args and _is_cuda_device(args[0]):
            return _CPU
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        # Pinned host memory needs an accelerator; it only speeds up the host->GPU copy that .cuda() then
        # skips here (RoPE's per-CP-rank positions: torch.tensor(..., pin_memory=True).cuda()).
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        # Tensor.to('cuda') / Tensor.to(0) / Tensor.to(torch.device('cuda'), dtype): device is positional.
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NoopStream:
    """Stands in for torch.cuda.Stream/ExternalStream: CPU work is already ordered, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoopEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoopEvent:
    """Stands in for torch.cuda.Event: recording/waiting orders nothing on the CPU; timing reads 0."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


_DEFAULT_STREAM = _NoopStream()


class _DropCpuRngWarning(logging.Filter):
    """Megatron's RNG tracker warns when the CPU RNG changes inside a CUDA-RNG fork. With the shim the
    'CUDA' generator *is* the CPU generator, so every fork that draws numbers would warn spuriously."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply() -> bool:
    """Install the redirects once; returns True if the shim is (now) active, False when CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        cuda = torch.cuda
        # current_device(): the index 0 it returns is turned into the CPU by _CudaToCpuMode where used
        # as a device, and indexes default_generators below where used for the RNG.
        cuda.current_device = lambda: 0
        cuda.device_count = lambda: 1
        cuda.set_device = lambda device: None
        # The RNG tracker (model_parallel_cuda_manual_seed, get_cuda_rng_tracker().fork()) saves and
        # restores the *CUDA* generator state around tensor-parallel init/dropout. On CPU the tensors
        # draw from the CPU default generator, so that generator is the one to track.
        cuda.default_generators = (torch.default_generator,)
        # Megatron reaches these both as torch.cuda.X and as torch.cuda.random.X.
        for module in (cuda, cuda.random):
            module.get_rng_state = lambda device="cuda": torch.get_rng_state()
            module.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
        # (torch.manual_seed itself calls cuda.manual_seed_all, which stays lazy and harmless: seed the
        # generator directly so there is no recursion.)
        cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
        cuda.random.manual_seed = cuda.manual_seed
        # Megatron's _set_cuda_rng_state defers through torch.cuda._lazy_call, which only *queues* the
        # call until CUDA initialises (never, here): the tracker would silently keep the wrong state.
        import megatron.core.tensor_parallel.random as mcore_random

        mcore_random._lazy_call = lambda callback, **kwargs: callback()
        logging.getLogger(mcore_random.__name__).addFilter(_DropCpuRngWarning())
        # synchronize / streams / events: used for overlap and timing; the CPU is synchronous.
        cuda.synchronize = lambda device=None: None
        cuda.Stream = _NoopStream
        cuda.ExternalStream = _NoopStream
        cuda.Event = _NoopEvent
        cuda.current_stream = lambda device=None: _DEFAULT_STREAM
        cuda.default_stream = lambda device=None: _DEFAULT_STREAM
        cuda.stream = lambda stream=None: contextlib.nullcontext()
        cuda.set_stream = lambda stream: None
        # Memory statistics (reported in logs by training loops): nothing is on a GPU.
        cuda.memory_allocated = lambda device=None: 0
        cuda.max_memory_allocated = lambda device=None: 0
        cuda.memory_reserved = lambda device=None: 0
        # device="cuda" / device=current_device() / .cuda() / .type(): see _CudaToCpuMode.
        _CudaToCpuMode().__enter__()
        _redirect_factories_in_backward()
        _applied = True
        return True


def _cpu_device_kwarg(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # see _CudaToCpuMode
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


def _redirect_factories_in_backward() -> None:
    """Torch-function modes are not active inside autograd backward (seen with torch 2.13: the mode stack is
    empty in a custom Function's backward). Megatron's MoE all-to-all runs its forward again in backward and
    allocates there with device=torch.cuda.current_device(); so the allocation calls themselves map a CUDA
    device argument to the CPU as well, whatever thread or mode they run under."""
    for name in ("empty", "zeros", "ones", "full", "arange", "tensor"):
        setattr(torch, name, _cpu_device_kwarg(getattr(torch, name)))
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        setattr(torch.Tensor, name, _cpu_device_kwarg(getattr(torch.Tensor, name)))

    # Activation recomputation (train.recompute) runs whole layers' forward inside backward: the MoE router moves
    # its weight with Tensor.to(device=torch.cuda.current_device()) there, so Tensor.to maps CUDA devices too.
    _to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = (_CPU, *args[1:])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        return _to(self, *args, **kwargs)
    torch.Tensor.to = to

    # The same backward all-to-all passes its split sizes as tensors (see _CudaToCpuMode): list them here too.
    def all_to_all_single(*args, **kwargs):
        for key in ("output_split_sizes", "input_split_sizes"):
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = kwargs[key].tolist()
        return _all_to_all_single(*args, **kwargs)
    torch.distributed.all_to_all_single = all_to_all_single


def is_applied() -> bool:
    """True once apply() has installed the redirects in this process."""
    return _applied
