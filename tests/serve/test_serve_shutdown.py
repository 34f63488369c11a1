"""Stopping a real `mtrain serve` process (SIGINT) with many streams in flight: every stream ends either finished
(its finish_reason, then `[DONE]`) or with an error event saying the server stops, never as a bare end of the
response; the process exits 0 and its log has no traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

STREAMS = 40


def _start(tmp_path):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "mtrain", "init-tiny", "--arch", "llama", "--out", str(model)], check=True,
                   capture_output=True, timeout=120)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model:\n  hf_path: {model}\n  dtype: float32\ndata:\n  task: arithmetic\n")
    env = dict(os.environ, MTRAIN_API_KEY="k", CUDA_VISIBLE_DEVICES="")
    p = subprocess.Popen([sys.executable, "-m", "mtrain", "serve", str(cfg), "serve.port=0", "serve.model_name=tiny",
                          "serve.default_max_tokens=100000", "serve.shutdown_grace_s=0",
                          f"serve.max_concurrency={STREAMS + 8}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if " at http" in line:
            return p, line.rsplit(" at ", 1)[1].strip(), lines
    p.kill()
    raise AssertionError("".join(lines))


def _stream(url: str, out: list, started: threading.Event, k: int) -> None:
    events = []
    try:
        with httpx.stream("POST", f"{url}/chat/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": f"count {k}"}],
                                "stream": True, "seed": k}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        end = "bare"
        if events and events[-1] == "[DONE]":
            finished = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
            end = "finished" if finished and finished[-1] else "done without finish_reason"
        elif events and json.loads(events[-1]).get("error", {}).get("code") == "server_shutting_down":
            end = "error event"
    except httpx.HTTPError as e:
        end = f"transport error {type(e).__name__}"
    out.append(end)


def test_sigint_with_many_streams_ends_each_with_done_or_an_error_event(tmp_path):
    p, url, lines = _start(tmp_path)
    try:
        results: list[str] = []
        started = [threading.Event() for _ in range(STREAMS)]
        threads = [threading.Thread(target=_stream, args=(url, results, started[k], k)) for k in range(STREAMS)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started), "not every stream started"
        p.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        rest, _ = p.communicate(timeout=60)
        log = "".join(lines) + rest
        assert p.returncode == 0, log
        assert len(results) == STREAMS
        bad = [r for r in results if r not in ("finished", "error event")]
        assert bad == [], f"{bad} ({results.count('finished')} finished)\n{log}"
        assert results.count("error event") > 0, results  # no grace: the streams still open were cut, by an event
        assert "Traceback" not in log and "ERROR" not in log, log
        assert f"{results.count('error event')} streams ended early with an error event" in log, log
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
