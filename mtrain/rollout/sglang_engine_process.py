"""Process-wide side of in-process SGLang engines: the SIGQUIT handler that marks live engines dead, the root logger
SGLang resets, the child processes a failed start leaves, and what is read from the model folder before a start."""
from __future__ import annotations

import json
import logging
import os
import weakref
from typing import Any

logger = logging.getLogger("mtrain.rollout.sglang_engine")

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the SGLangEngines of this process not yet shut down


def _server_arg_names() -> list[str]:
    """The argument names sglang.Engine takes (its ServerArgs dataclass's fields)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs
    return [f.name for f in dataclasses.fields(ServerArgs)]


def _config_of(model_path: str) -> dict | None:
    """The model folder's config.json, or None when it cannot be read (SGLang then reports it at start)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _vision_of(model_path: str) -> tuple[int | None, str]:
    """(image_token_id or None, model_type) from the model folder's config.json (a VLM declares vision_config)."""
    cfg = _config_of(model_path)
    if cfg is None:
        return None, "unknown"
    vlm = isinstance(cfg.get("vision_config"), dict) and cfg.get("image_token_id") is not None
    return (int(cfg["image_token_id"]) if vlm else None), str(cfg.get("model_type", "unknown"))


def _on_sigquit(signum: int, frame: Any) -> None:
    """A scheduler or detokenizer of some engine in this process died (SGLang signals its parent). We cannot
    tell which engine: every live one is marked dead, and its waiting calls fail with EngineError."""
    logger.error("SGLang: a child process died (SIGQUIT)")
    for engine in list(_LIVE):
        engine._on_engine_death()


def logging_state() -> tuple:
    root = logging.getLogger()
    return root.level, list(root.handlers)


def restore_logging(state: tuple) -> None:
    """Undo SGLang's `logging.basicConfig(force=True, level=...)` on the trainer's root logger."""
    root = logging.getLogger()
    level, handlers = state
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new_children(before: set[int]) -> None:
    """Kill the processes a failed engine start left behind, by pid; other children are not touched."""
    import psutil

    for pid in sorted(_child_pids() - before):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
