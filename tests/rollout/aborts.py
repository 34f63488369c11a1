"""A real abort in the middle of generation, for the partial-rollout tests."""
from __future__ import annotations

import threading
import time


def abort_after(engine, rid_prefix: str, tokens: int) -> None:
    """Abort the request(s) with this rid prefix once one has generated at least `tokens` tokens."""
    def watch():
        while True:
            if any(v >= tokens for r, v in engine.active_requests().items() if r.startswith(rid_prefix)):
                engine.abort(rid_prefix)
                return
            time.sleep(0.0002)
    threading.Thread(target=watch, daemon=True).start()
