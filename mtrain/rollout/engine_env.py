"""Start an in-process SGLang engine without torchrun's environment.

`sglang.Engine` spawns its scheduler processes with `multiprocessing` "spawn"; they inherit `os.environ`.
When they see torchrun's rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) SGLang's own
`torch.distributed` initialisation picks them up and waits forever for peers that never come (seen on the
H200, DESIGN.md). So the variables leave `os.environ` while the engine starts, and come back afterwards.

The whole environment is restored, not only torchrun's part: `sglang.Engine.__init__` also writes
process-wide variables for its children (NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS=8,
CUDA_MODULE_LOADING, TRTLLM_ENABLE_PDL, CUTE_DSL_*, SGLANG_RUN_ID; `entrypoints/engine.py:1574-1615`). The
children already have their copy once they are spawned; the training process should keep its own settings
(Megatron and its NCCL communicators read them).

`os.environ` is process-wide: do not start an engine while another thread reads the environment.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping, MutableMapping

# Exact names torchrun (torch.distributed.elastic) exports to every worker.
TORCHRUN_NAMES: frozenset[str] = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
})
# Families: ROLE_RANK/ROLE_NAME/ROLE_WORLD_SIZE, TORCHELASTIC_RUN_ID/_RESTART_COUNT/_MAX_RESTARTS/...
TORCHRUN_PREFIXES: tuple[str, ...] = ("ROLE_", "TORCHELASTIC_")


def torchrun_variables(environ: Mapping[str, str]) -> list[str]:
    """Names in `environ` that torchrun set and that must not reach SGLang's scheduler processes."""
    return sorted(k for k in environ if k in TORCHRUN_NAMES or k.startswith(TORCHRUN_PREFIXES))


@contextmanager
def engine_environment(
    extra: Mapping[str, str] | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> Iterator[list[str]]:
    """Within the block: torchrun's variables are gone and `extra` is set. After it (also on exception):
    `environ` is exactly what it was before, whatever the block wrote. Yields the names it removed."""
    env = os.environ if environ is None else environ
    snapshot = dict(env)
    removed = torchrun_variables(env)
    for k in removed:
        del env[k]
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            _restore(env, snapshot)
            raise TypeError(f"engine_environment: extra variables must be str -> str, got {k!r}: {v!r}")
        env[k] = v
    try:
        yield removed
    finally:
        _restore(env, snapshot)


def _restore(env: MutableMapping[str, str], snapshot: Mapping[str, str]) -> None:
    # Touch only what differs: every write to os.environ is a putenv/unsetenv call.
    for k in [k for k in env if k not in snapshot]:
        del env[k]
    for k, v in snapshot.items():
        if env.get(k) != v:
            env[k] = v
