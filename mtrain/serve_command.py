"""`mtrain serve CONFIG.yaml [a.b.c=value ...]`: the OpenAI front on the configured model, without training.

For trying an agent before training it, and for evaluation. One process, one engine (SGLang on a GPU machine, the
reference engine elsewhere, decided as for a run: `mtrain.trainer.decisions`), the weights of `model.hf_path`.
Prints the base URL and where the API key comes from, then serves until SIGINT/SIGTERM, and stops cleanly
(the server, then the engine). A command, above the trainer: it picks the engine as a run does.
"""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from mtrain.serve.api_key import api_key_of


def make_serving_engine(cfg, hf_dir: Path, hf_config: dict):
    from mtrain.trainer.decisions import decide
    d = decide(cfg, world_size=cfg.engine.tp, local_world_size=cfg.engine.tp)
    if d.engine_kind == "reference":
        from mtrain.rollout.reference_engine import ReferenceEngine
        return ReferenceEngine.from_pretrained(str(hf_dir), dtype=d.engine_dtype)
    from mtrain.rollout.sglang_engine import SGLangEngine
    server_args = {"dtype": cfg.engine_dtype}
    if cfg.engine.attention_backend:
        server_args["attention_backend"] = cfg.engine.attention_backend
    server_args.update(cfg.engine.server_args)  # mtrain/engine_args.py refused the keys mtrain decides
    return SGLangEngine(str(hf_dir), tp_size=cfg.engine.tp, mem_fraction_static=cfg.engine.mem_fraction_static,
                        random_seed=cfg.train.seed, server_args=server_args)


def serve(cfg) -> int:
    from mtrain.rollout.client import LocalClient
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer
    from mtrain.serve.sessions import SessionStore
    from mtrain.trainer.engines import load_tokenizer

    hf_dir = Path(cfg.model.hf_path)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    sv = cfg.serve
    key, source = api_key_of(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the engine starts: a signal while loading also stops
        signal.signal(sig, lambda *_: stop.set())
    tokenizer = load_tokenizer(hf_dir, hf_config)
    engine = make_serving_engine(cfg, hf_dir, hf_config)
    try:
        front = OpenAIFront(LocalClient(engine), tokenizer, model_name=sv.model_name or hf_dir.resolve().name,
                            max_positions=int(hf_config.get("max_position_embeddings", 4096)),
                            default_max_tokens=sv.default_max_tokens, tool_parser=sv.tool_parser)
        front.sessions = SessionStore(max_sessions=sv.max_sessions, ttl_s=sv.session_ttl_s,  # nobody takes them
                                      max_session_tokens=sv.max_session_tokens)
        server = FrontServer(front, host=sv.host, port=sv.port, api_key=key, max_body_bytes=sv.max_body_kb * 1024,
                             max_concurrency=sv.max_concurrency, shutdown_grace_s=sv.shutdown_grace_s,
                             read_timeout_s=sv.read_timeout_s)
        server.start()
        print(f"mtrain serve: model {front.model_name!r} at {server.base_url}", flush=True)
        print(f"mtrain serve: API key: {source}", flush=True)
        if key is None:
            print(f"mtrain serve: API key {server.api_key}", flush=True)
        print("mtrain serve: sessions: POST /sessions, then base_url /sessions/{id}/v1; stop with SIGINT/SIGTERM",
              flush=True)
        while not stop.wait(0.5):
            pass
        print("mtrain serve: stopping", flush=True)
        cut = server.stop()
        print(f"mtrain serve: stopped ({cut} streams ended early with an error event, "
              f"{front.sessions.expired} sessions expired)", flush=True)
    finally:
        engine.shutdown()
    return 0
