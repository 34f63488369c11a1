"""Weight loaders that run INSIDE SGLang's scheduler processes (one per engine TP rank).

SGLang calls a loader registered with the `custom_weight_loader` server argument as
`loader(model, named_tensors)` when `update_weights_from_tensor(..., load_format="<its import path>")` arrives
(`model_executor/model_runner_components/weight_updater.py:346-348`); `named_tensors` is this rank's own
payload, already on this rank's GPU (CUDA IPC, no host copy).

Names are SGLang's internal parameter names (`dict(model.named_parameters())`) with per-rank shapes:
    "model.layers.3.self_attn.qkv_proj.weight"        the whole per-rank parameter
    "model.layers.3.mlp.experts.w13_weight@8:16"      rows [8, 16) along dim 0 of it
The row-range form writes part of a parameter: local experts 8..15 of a FusedMoE weight, or one piece of a
tensor too big for one bucket. The tensor must have exactly the destination's shape and dtype; nothing is
cast or re-sliced here (the planner already produced per-rank shards). One exception, an FP8 engine: a
float32/bf16/fp16 tensor for a float8_e4m3fn parameter `X` is quantized into `X` and its scale, in the format the
engine holds: `X_scale_inv` block FP8 (whole 128x128 blocks), or `X_scale` per-channel FP8 (X a [K, N] view of the
[N, K] rows the bucket carries; whole parameters only); `mtrain.kernels` BlockFp8, one kernel launch per bucket.

Control names (a zero-size tensor goes with them):
    FINISH_NAME      end of a sync: the attention layers' KV scales to 1.0 (`reset_kv_scales`),
                     then run the model's post-load hook (DeepSeek's kv_b_proj -> w_kc/w_vc).
    DUMP_PREFIX+JSON dump_params only: {"dir": ..., "names": [...] | null, "what": "sha256" | "tensors"}.

A loader must never raise: an exception in a scheduler process makes SGLang SIGQUIT the parent, whose
handler kills the whole process tree -- the training process included (`managers/scheduler.py:4949-4952`,
`managers/tokenizer_manager.py:3753-3763`). So every error is caught, nothing of the bucket is written
(all entries are validated before the first copy), and the message goes to a file in the directory named by
$MTRAIN_SGLANG_STATUS_DIR, which the engine adapter reads after each call and turns into an EngineError.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
import weakref
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from mtrain.kernels import PieceTableError, ScatterTable, execute_scatter
from mtrain.kernels.fp8 import FP8, SRC_DTYPES
from mtrain.reshard.targets import (LoaderError, Target, fp8_storage, own_fp8_spec, synchronize, target_view,
                                   unknown_param)

LOAD_DIRECT = "mtrain.rollout.sglang_loader.load_direct"
DUMP_PARAMS = "mtrain.rollout.sglang_loader.dump_params"
FINISH_NAME = "__mtrain_finish__"
DUMP_PREFIX = "__mtrain_dump__"
STATUS_DIR_ENV = "MTRAIN_SGLANG_STATUS_DIR"
ERROR_FILE_PREFIX = "error."

logger = logging.getLogger(__name__)

# SIGUSR1 dumps every thread's stack (mtrain/debug_signals.py, sent by benchmarks/hang_dump.sh). The schedulers import
# this module as they start: unpickling their server args imports sglang_wire (our custom_sigquit_handler), which
# imports this module; the 2 x H200 dump of 2026-11-30 has scheduler stacks from inside the engine's warm-up. Only where SIGUSR1 has no Python handler: SGLang 0.5.17 sets
# none, and one it may set later wins. Guarded: an exception here would fail the import, hence the loader call, and
# SGLang would then kill the whole process tree (module docstring).
try:
    from mtrain.debug_signals import install_stack_dump_signal

    install_stack_dump_signal(only_if_default=True)
except Exception:  # noqa: BLE001 -- a debugging aid must never cost the weight sync
    pass


# Parameters written since the last FINISH_NAME, per scheduler process (one process = one TP rank).
_touched_since_finish: set[str] = set()
# The last bucket's tensors, kept alive on purpose: torch caches an opened CUDA IPC mapping only while a tensor
# on it lives. The trainer reuses one bucket buffer, so keeping it mapped saves a cudaIpcOpenMemHandle /
# close pair on every bucket (the fixed per-bucket cost measured on the H200: ~4 ms).
_keepalive: list = []




def plan_copies(
    params: Mapping[str, torch.Tensor], named_tensors: Sequence[tuple[str, Any]]
) -> list[tuple[Target, torch.Tensor, torch.Tensor]]:
    """Validate a whole bucket against the parameters before anything is written.

    Returns (target, destination view, source) triples. Raises LoaderError naming the first bad entry:
    unknown parameter, row range out of bounds, shape or dtype mismatch, two entries writing the same rows.
    """
    plan: list[tuple[Target, torch.Tensor, torch.Tensor]] = []
    written: dict[str, list[tuple[int, int]]] = {}
    for entry in named_tensors:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise LoaderError(f"bucket entries must be (name, tensor) pairs, got {type(entry).__name__}")
        name, tensor = entry
        target, dst, span = target_view(params, name)
        if not isinstance(tensor, torch.Tensor):
            raise LoaderError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        fp8 = dst.dtype == FP8 and isinstance(tensor, torch.Tensor) and tensor.dtype in SRC_DTYPES
        if fp8 and own_fp8_spec(params, target.param).scaling == "channel":  # checks the scale
            if target.start is not None:
                raise LoaderError(f"{name}: a per-channel FP8 parameter is written whole (no row range)")
            dst = fp8_storage(dst, "channel")  # the bucket holds the [N, K] rows of SGLang's [K, N] view
        if tuple(tensor.shape) != tuple(dst.shape):
            raise LoaderError(f"{name}: shape {tuple(tensor.shape)} does not match {target.param}"
                              f"{'' if target.start is None else f'[{target.start}:{target.stop}]'} "
                              f"shape {tuple(dst.shape)}")
        if fp8:
            own_fp8_spec(params, target.param)  # checks the scale
        elif tensor.dtype != dst.dtype:
            raise LoaderError(f"{name}: dtype {tensor.dtype} does not match {target.param} dtype {dst.dtype} "
                              "(the loader never casts)")
        for a, b in written.get(target.param, []):
            if span[0] < b and a < span[1]:
                raise LoaderError(f"{name}: rows [{span[0]}, {span[1]}) of {target.param} are written twice in "
                                  f"one bucket (also [{a}, {b}))")
        written.setdefault(target.param, []).append(span)
        plan.append((target, dst, tensor))
    return plan




# Push buckets repeat every sync: their FP8 tables (and the kernel's per-table caches) are kept by bucket layout.
_fp8_tables: dict[tuple, ScatterTable] = {}


def apply_copies(plan: Sequence[tuple[Target, torch.Tensor, torch.Tensor]],
                 params: Mapping[str, torch.Tensor] | None = None) -> None:
    quantized = []
    for target, dst, src in plan:
        if dst.dtype == FP8 and src.dtype != FP8:
            quantized.append((target, dst, src))
        else:
            dst.copy_(src, non_blocking=True)
    if quantized:
        _apply_fp8(quantized, params)
    synchronize([dst for _, dst, _ in plan])  # the sources are the trainer's reused bucket buffers


def _apply_fp8(entries, params: Mapping[str, torch.Tensor]) -> None:
    """One execute_scatter for a bucket's FP8 entries: each a contiguous run into its parameter (rows a..b)."""
    dsts, srcs, quant, rows = [], [], {}, []
    for i, (target, dst, src) in enumerate(entries):
        whole = params[target.param]
        spec = own_fp8_spec(params, target.param)
        start = (target.start or 0) * (whole[0].numel() if whole.dim() > 0 else 1)
        n = src.numel()
        dsts.append(fp8_storage(whole.data, spec.scaling).view(-1))
        srcs.append(src.contiguous().view(-1))
        quant[i] = spec
        rows.append([i, 0, n, start, n, 1, n, i])
    key = tuple((str(t), tuple(s.shape)) for t, _, s in entries)
    table = _fp8_tables.get(key)
    if table is None:
        if len(_fp8_tables) > 256:
            _fp8_tables.clear()
        table = _fp8_tables[key] = ScatterTable.from_rows(np.asarray(rows, dtype=np.int64))
    try:
        execute_scatter(dsts, srcs, table, quant=quant)
    except PieceTableError as e:
        raise LoaderError(f"FP8 bucket: {e}") from None


def post_load_kwargs(hook: Any, touched: Sequence[str]) -> dict | None:
    """How to call a model's `post_load_weights` after a sync, or None to skip it.

    DeepSeek's hook (`deepseek_weight_loader.py:474`) takes `weight_names` and re-derives w_kc/w_vc only for
    the layers whose kv_b_proj appears there; other hooks take no arguments (SGLang's own loaders call them
    that way: `model_loader/loader.py:333-339`).
    """
    params = inspect.signature(hook).parameters
    if "weight_names" in params:
        names = sorted(n for n in touched if "kv_b_proj" in n)
        return {"weight_names": names} if names else None
    return {}


_kv_scale_layers: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def reset_kv_scales(model: torch.nn.Module) -> int:
    """Set every attention layer's k/v scale -- the `k_scale`/`v_scale` parameters and the `k_scale_float`/
    `v_scale_float` SGLang reads -- to 1.0; returns how many layers have them.

    Only an FP8 engine's attention layers have them (`layers/quantization/kv_cache.py:41-48`), and 1.0 is what
    SGLang derives for a checkpoint without KV scales (:58-62), which ours never carry. Two things break them
    otherwise. (1) Our engines start from dummy weights, which overwrite the -1.0 placeholders with random values
    (`model_loader/weight_utils.py:1532-1546`); a positive one becomes the scale. The triton backend multiplies
    attention scores by the float (`attention/triton_backend.py:1366-1368`), so a bf16-cached MHA model (Llama)
    attends with scores scaled by ~1e-4. (2) Releasing the "weights" memory tag discards the parameters like every
    load-time allocation (only buffers are restored); MLA divides K by the *parameter* before caching it
    (`triton_backend.py:1292-1304`) and multiplies by the float when reading. DeepSeek on an FP8 engine went from
    a 0.08 to a 0.79 mean logprob gap after the first release (docs/results.md section 29)."""
    layers = _kv_scale_layers.get(model)
    if layers is None:
        found = [m for m in model.modules()
                 if all(isinstance(getattr(m, f"{w}_scale", None), torch.Tensor) and hasattr(m, f"{w}_scale_float")
                        for w in "kv")]
        check_graph_kv_scales(found, cuda_graphs_on())  # first sync: the floats are still those of the start
        layers = _kv_scale_layers[model] = found
    with torch.no_grad():
        for m in layers:
            m.k_scale.fill_(1.0)
            m.v_scale.fill_(1.0)
            m.k_scale_float = m.v_scale_float = 1.0
    return len(layers)


def cuda_graphs_on() -> bool:
    """Whether this scheduler captured decode CUDA graphs (SGLang's server args of this process)."""
    try:
        from sglang.srt.server_args import get_global_server_args
        return not get_global_server_args().disable_cuda_graph
    except Exception:  # noqa: BLE001 -- no SGLang here (CPU tests) or not a scheduler: no graphs
        return False


def check_graph_kv_scales(layers: Sequence[torch.nn.Module], graphs: bool) -> None:
    """Refuse an engine whose decode CUDA graphs captured KV scales other than 1.0. A graph keeps the Python floats
    `k_scale_float`/`v_scale_float` as kernel arguments from the engine's start (the value SGLang derived from the
    dummy start weights, ~1e-4: the triton backend scales attention scores by it), and `reset_kv_scales` cannot
    reach into it. Which models are hit is SGLang's model code (those that pass the quantization config to
    RadixAttention: Llama, Qwen2, DeepSeek, ...; not Qwen3 or Qwen3-MoE), so it is checked here, at the first sync,
    before any rollout. Without graphs, or with every captured scale 1.0, nothing is refused."""
    if not graphs:
        return
    bad = [m for m in layers if float(m.k_scale_float) != 1.0 or float(m.v_scale_float) != 1.0]
    if bad:
        raise LoaderError(
            f"this FP8 engine captured CUDA graphs with KV scales SGLang derived from its dummy start weights "
            f"(k_scale {float(bad[0].k_scale_float):.3g} in {len(bad)} attention layers), which no sync can change: "
            "this model's FP8 engine must run without graphs (engine.cuda_graphs=false)")


def run_post_load_hooks(model: Any, touched: Sequence[str]) -> None:
    """End of a sync: the attention layers' KV scales to 1.0, then the model's own hook."""
    reset_kv_scales(model)
    hook = getattr(model, "post_load_weights", None)
    if hook is None:
        return
    kwargs = post_load_kwargs(hook, touched)
    if kwargs is not None:
        hook(**kwargs)


def select_params(params: Mapping[str, torch.Tensor], names: Sequence[str] | None) -> dict[str, torch.Tensor]:
    if names is None:
        return dict(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise unknown_param(missing[0], params)
    return {n: params[n] for n in names}


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the raw bytes (dtype-exact, device-independent)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def param_checksums(params: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    return {n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "sha256": tensor_sha256(p)}
            for n, p in params.items()}


def parse_dump_spec(named_tensors: Sequence[tuple[str, Any]]) -> dict:
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(DUMP_PREFIX):
        raise LoaderError(f"dump_params expects exactly one ({DUMP_PREFIX}<json>, tensor) entry, "
                          f"got {[n for n, _ in named_tensors][:3]}")
    try:
        spec = json.loads(named_tensors[0][0][len(DUMP_PREFIX):])
    except json.JSONDecodeError as e:
        raise LoaderError(f"dump_params: bad JSON spec: {e}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("dir"), str):
        raise LoaderError(f"dump_params: spec needs a 'dir' string, got {spec!r}")
    if spec.get("what", "sha256") not in ("sha256", "tensors"):
        raise LoaderError(f"dump_params: 'what' must be 'sha256' or 'tensors', got {spec.get('what')!r}")
    names = spec.get("names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise LoaderError(f"dump_params: 'names' must be null or a list of str, got {names!r}")
    return {"dir": spec["dir"], "what": spec.get("what", "sha256"), "names": names}


def write_dump(params: Mapping[str, torch.Tensor], spec: dict, rank: int) -> str:
    """Write this rank's dump to <dir>/rank<r>.json (checksums) or .pt (CPU tensors); returns the path."""
    chosen = select_params(params, spec["names"])
    os.makedirs(spec["dir"], exist_ok=True)
    ext = "json" if spec["what"] == "sha256" else "pt"
    path = os.path.join(spec["dir"], f"rank{rank}.{ext}")
    fd, tmp = tempfile.mkstemp(dir=spec["dir"], prefix=f".rank{rank}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if spec["what"] == "sha256":
                f.write(json.dumps(param_checksums(chosen), indent=0, sort_keys=True).encode())
            else:
                torch.save({n: p.detach().cpu().clone() for n, p in chosen.items()}, f)
        os.replace(tmp, path)  # readers never see a half-written file
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _rank() -> int:
    # SGLang's scheduler initialises torch.distributed over its TP (x PP) ranks; with PP = 1 this is the TP rank.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def report_error(message: str, status_dir: str | None = None) -> None:
    """Leave the error where the adapter looks for it; never raises (see the module docstring)."""
    status_dir = status_dir if status_dir is not None else os.environ.get(STATUS_DIR_ENV)
    logger.error("mtrain loader: %s", message)
    if not status_dir:
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=status_dir, prefix=".err.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(f"engine rank {_rank()} (pid {os.getpid()}): {message}")
        os.replace(tmp, os.path.join(status_dir, f"{ERROR_FILE_PREFIX}rank{_rank()}.{os.getpid()}.txt"))
    except OSError as e:  # the status dir vanished: the log line above is all that is left
        logger.error("mtrain loader: could not write the error file in %s: %s", status_dir, e)


def collect_errors(status_dir: str) -> list[str]:
    """Read and delete the error files the loaders left (adapter side)."""
    out = []
    for fname in sorted(os.listdir(status_dir)):
        if fname.startswith(ERROR_FILE_PREFIX):
            path = os.path.join(status_dir, fname)
            with open(path) as f:
                out.append(f.read())
            os.unlink(path)
    return out


_params_of: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """named_parameters() once per model: thousands of names for a MoE model, and it is the same every bucket.
    Weakly keyed: a new model at a dead one's address must not inherit its parameters."""
    params = _params_of.get(model)
    if params is None:
        params = _params_of[model] = dict(model.named_parameters())
    return params


def load_direct(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang custom weight loader: copy per-rank shards into the parameters (see the module docstring)."""
    try:
        from mtrain.reshard import pull_protocol

        if pull_protocol.is_pull(named_tensors):
            names, finish = pull_protocol.run_pull(_params(model), named_tensors)
            _touched_since_finish.update(names)
            if finish:
                run_post_load_hooks(model, sorted(_touched_since_finish))
                _touched_since_finish.clear()
            return
        if any(n == FINISH_NAME for n, _ in named_tensors):
            if len(named_tensors) != 1:
                raise LoaderError(f"{FINISH_NAME} must be sent alone, got {len(named_tensors)} entries")
            run_post_load_hooks(model, sorted(_touched_since_finish))
            _touched_since_finish.clear()
            return
        params = _params(model)
        plan = plan_copies(params, named_tensors)
        apply_copies(plan, params)
        _touched_since_finish.update(t.param for t, _, _ in plan)
        _keepalive[:] = [t for _, t in named_tensors[:1]]
    except Exception as e:  # noqa: BLE001 -- raising here would kill the training process (module docstring)
        report_error(f"{type(e).__name__}: {e}")


def dump_params(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang custom weight loader that writes parameters instead of reading them.

    Lets a test compare what SGLang holds after a direct sync with what it holds after a load from disk, for
    models without `get_weights_by_name` (Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3 in 0.5.17).
    """
    try:
        spec = parse_dump_spec(named_tensors)
        write_dump(dict(model.named_parameters()), spec, _rank())
    except Exception as e:  # noqa: BLE001 -- see load_direct
        report_error(f"dump_params: {type(e).__name__}: {e}")
