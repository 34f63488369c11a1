"""The pull-mode wire protocol, engine-neutral: an engine rank writes its parameters from the trainer's memory.

A pull request is one `update_weights_from_tensor` payload per engine rank, handled by `sglang_loader.load_direct`:
    [(PULL_PREFIX + json spec, zero-size tensor), (SOURCE_NAME, source 0), (SOURCE_NAME, source 1), ...]
spec = {"table": key, "sources": key, "n_sources": k, "finish": bool,
        "targets": [[param name, shape], ...], "rows": [[8 ints], ...],   # targets/rows: first use of `table` only
        "quant": [[target index, scale name, scale shape, [bn, bk], scaling], ...]}  # with targets, FP8 engine
Sources (the trainer's parameters and receive buffers, as CUDA IPC views) come only when their key is new; the
loader keeps them, so their IPC mappings are opened once. Tables are validated, resolved to the parameters
and cached per key. Each call then runs `mtrain.kernels.execute_scatter`: one launch per parameter dtype.
Everything is checked before the first write (the kernel validates the whole table before it launches); errors
are raised as LoaderError and reported by load_direct, which never raises (see sglang_loader's docstring).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from mtrain.kernels import BlockFp8, PieceTableError, ScatterTable, execute_scatter
from mtrain.reshard.targets import LoaderError, fp8_spec, fp8_storage, synchronize, target_view

PULL_PREFIX = "__mtrain_pull__"
SOURCE_NAME = "__mtrain_src__"


@dataclass
class PullState:
    """Per scheduler process: the sources it holds and the tables it has resolved."""

    sources_key: str | None = None
    sources: list[torch.Tensor] = field(default_factory=list)
    plan: str | None = None  # tables of one plan at a time: a new plan's first table drops the old ones
    tables: dict[str, tuple[ScatterTable, list[str], list[torch.Tensor], dict[int, BlockFp8]]] = field(default_factory=dict)


STATE = PullState()  # this scheduler process's (one engine rank's)


def is_pull(named_tensors: Sequence[tuple[str, Any]]) -> bool:
    return bool(named_tensors) and isinstance(named_tensors[0], (tuple, list)) \
        and str(named_tensors[0][0]).startswith(PULL_PREFIX)


def parse_spec(named_tensors: Sequence[tuple[str, Any]]) -> dict:
    try:
        spec = json.loads(named_tensors[0][0][len(PULL_PREFIX):])
    except json.JSONDecodeError as e:
        raise LoaderError(f"pull: bad JSON spec: {e}") from None
    if not isinstance(spec, dict):
        raise LoaderError(f"pull: spec must be a JSON object, got {type(spec).__name__}")
    for k, typ in (("table", str), ("sources", str), ("n_sources", int), ("finish", bool)):
        if not isinstance(spec.get(k), typ):
            raise LoaderError(f"pull: spec field {k!r} must be a {typ.__name__}, got {spec.get(k)!r}")
    if ("targets" in spec) != ("rows" in spec):
        raise LoaderError("pull: spec must carry both 'targets' and 'rows' or neither")
    attached = len(named_tensors) - 1
    if attached != spec["n_sources"]:
        raise LoaderError(f"pull: spec says {spec['n_sources']} sources, {attached} tensors attached")
    bad = [n for n, _ in named_tensors[1:] if n != SOURCE_NAME]
    if bad:
        raise LoaderError(f"pull: attached tensors must be named {SOURCE_NAME!r}, got {bad[0]!r}")
    return spec


def _resolve_targets(spec: dict, params: Mapping[str, torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    names, dsts = [], []
    targets = spec["targets"]
    if not isinstance(targets, list):
        raise LoaderError("pull: 'targets' must be a list of [name, shape]")
    quant_entries = _quant_entries(spec, len(targets))
    channel = {e[0] for e in quant_entries if e[4] == "channel"}
    for i, entry in enumerate(targets):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            raise LoaderError(f"pull: bad target entry {entry!r}: expected [name, shape]")
        target, view, _ = target_view(params, entry[0])
        if i in channel and view.dtype == torch.float8_e4m3fn:  # the plan's [N, K] is the storage of SGLang's view
            view = fp8_storage(view, "channel")
        if list(view.shape) != entry[1]:
            raise LoaderError(f"pull: {entry[0]}: the trainer's plan has shape {tuple(entry[1])}, the engine's parameter "
                        f"{tuple(view.shape)} (different model config or engine TP/EP?)")
        if not view.is_contiguous():
            raise LoaderError(f"pull: {entry[0]}: the engine's parameter is not contiguous")
        names.append(target.param)
        dsts.append(view.view(-1))
    return names, dsts, _resolve_quant(quant_entries, params, targets)


def _quant_entries(spec: dict, n_targets: int) -> list:
    """spec["quant"], checked: [target index, scale name, scale shape, block, scaling] (scaling may be left out:
    block)."""
    entries = spec.get("quant", [])
    if not isinstance(entries, list):
        raise LoaderError("pull: 'quant' must be a list of [target index, scale name, scale shape, block, scaling]")
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) in (4, 5) and isinstance(entry[0], int)
                and 0 <= entry[0] < n_targets):
            raise LoaderError(f"pull: bad quant entry {entry!r}: expected [target index, scale name, shape, block, "
                              "scaling]")
        out.append(entry if len(entry) == 5 else entry + ["block"])
    return out


def _resolve_quant(entries: list, params: Mapping[str, torch.Tensor], targets: list) -> dict[int, BlockFp8]:
    """The trainer's FP8 targets, checked against the engine's parameters: FP8 on both sides or on neither, in the
    same format (a per-channel plan for a block engine finds no `weight_scale`, and the other way round)."""
    quant: dict[int, BlockFp8] = {}
    for i, scale_name, scale_shape, block, scaling in entries:
        quant[i] = fp8_spec(params, targets[i][0], scale_name, scale_shape, block, scaling)
    for i, (name, _) in enumerate(targets):
        if i not in quant and params[name.split("@")[0]].dtype == torch.float8_e4m3fn:
            raise LoaderError(f"pull: {name} is float8_e4m3fn in this engine (an FP8 engine) but the trainer's plan "
                              "writes it unquantized: set engine.weight_dtype=fp8 for this engine")
    return quant


def _table(spec: dict) -> ScatterTable:
    try:
        rows = np.asarray(spec["rows"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise LoaderError(f"pull: 'rows' must be a list of 8-integer rows: {e}") from None
    if rows.size == 0:
        rows = rows.reshape(0, 8)
    if rows.ndim != 2 or rows.shape[1] != 8:
        raise LoaderError(f"pull: 'rows' must be [N, 8] integers, got shape {list(rows.shape)}")
    return ScatterTable.from_rows(rows)


def run_pull(params: Mapping[str, torch.Tensor], named_tensors: Sequence[tuple[str, Any]],
             state: PullState = STATE) -> tuple[list[str], bool]:
    """Execute one pull request; returns (parameters written, finish?). Raises LoaderError with one clear message."""
    spec = parse_spec(named_tensors)
    if spec["n_sources"]:
        sources = [t for _, t in named_tensors[1:]]
        for i, t in enumerate(sources):
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise LoaderError(f"pull: source {i} must be a contiguous tensor")
        sources = [t.view(-1) for t in sources]
    elif spec["sources"] == state.sources_key:
        sources = state.sources
    else:
        raise LoaderError(f"pull: sources {spec['sources']!r} are not held by this engine rank (it holds "
                          f"{state.sources_key!r}); the trainer must send them")
    cached = state.tables.get(spec["table"])
    if "targets" in spec:
        names, dsts, quant = _resolve_targets(spec, params)
        cached = (_table(spec), names, dsts, quant)
    elif cached is None:
        raise LoaderError(f"pull: table {spec['table']!r} is not held by this engine rank; the trainer must send it")
    table, names, dsts, quant = cached
    try:
        execute_scatter(dsts, sources, table, quant=quant)
    except PieceTableError as e:
        raise LoaderError(f"pull: table {spec['table']!r} does not fit: {e}") from None
    synchronize(dsts)  # the trainer may change its tensors once the call returns
    # Kept only after a clean run: a bad table or source set never replaces good ones.
    state.sources_key, state.sources = spec["sources"], sources
    plan = spec["table"].split("/", 1)[0]
    if plan != state.plan:
        state.plan, state.tables = plan, {}
    state.tables[spec["table"]] = cached
    return names, spec["finish"]


class PullSender:
    """Trainer side of the protocol: one engine's payloads, with sources and tables sent only when new to it."""

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self.forget()

    def forget(self) -> None:
        """After a failed call nothing is assumed held: the next call sends everything again."""
        self.sources = [None] * self.n_ranks
        self.tables: list[set[str]] = [set() for _ in range(self.n_ranks)]

    def payload(self, rank: int, job, finish: bool, marker: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`job` is a `mtrain.reshard.pull.PullJob` for engine rank `rank`; `marker` a zero-size tensor to carry
        the spec (on the GPU for SGLang, whose patched tensor pickling handles only CUDA storages)."""
        send_sources = self.sources[rank] != job.sources_key
        spec = {"table": job.table_key, "sources": job.sources_key, "finish": bool(finish),
                "n_sources": len(job.sources) if send_sources else 0}
        if job.table_key not in self.tables[rank]:
            spec["targets"] = [[name, list(shape)] for name, shape in job.targets]
            spec["rows"] = job.rows.tolist()
            quant = getattr(job, "quant", None) or {}
            if quant:
                spec["quant"] = [[i, q.scale_name, list(q.scale_shape), list(q.block), q.scaling]
                                 for i, q in sorted(quant.items())]
        out = [(PULL_PREFIX + json.dumps(spec, separators=(",", ":")), marker)]
        if send_sources:
            out += [(SOURCE_NAME, t) for t in job.sources]
        return out

    def confirm(self, rank: int, job) -> None:
        """The engine rank ran `job`: it now holds its sources and table."""
        self.sources[rank] = job.sources_key
        self.tables[rank].add(job.table_key)
