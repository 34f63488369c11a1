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


def _call(url: str, out: list, k: int, stream: bool) -> None:
    """A call made just before the stop: its answer, a finished result or an OpenAI-shaped error, never a
    plain-text 500 or a dropped connection."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"count {k}"}], "seed": k, "stream": stream}
    try:
        with httpx.stream("POST", f"{url}/chat/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                          json=body) as r:
            raw = r.read().decode()
        if r.status_code == 200 and not stream:
            out.append("finished" if json.loads(raw)["choices"][0]["finish_reason"] else "no finish_reason")
        elif r.status_code == 200:
            events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
            last = json.loads(events[-2]) if events and events[-1] == "[DONE]" else json.loads(events[-1])
            out.append("finished" if events[-1] == "[DONE]" else
                       f"error event {last.get('error', {}).get('code')}")
        else:
            out.append(f"{r.status_code} {json.loads(raw)['error']['code']}")  # plain text fails here
    except Exception as e:  # noqa: BLE001 - any other end is what the test looks for
        out.append(f"{type(e).__name__}: {e}")


def test_calls_waiting_at_the_stop_get_an_openai_error_and_the_log_no_traceback(tmp_path):
    """Non-streamed calls and streams still waiting for their first token when the grace period (0 s) ends: each
    gets a JSON 503 `server_shutting_down` (or its result), the process exits 0 with no traceback in its log."""
    p, url, lines = _start(tmp_path)
    try:
        results: list[str] = []
        threads = [threading.Thread(target=_call, args=(url, results, k, k % 2 == 1)) for k in range(STREAMS)]
        for t in threads:
            t.start()
        deadline, seen = time.time() + 60, 0
        while time.time() < deadline and seen < STREAMS // 2:  # calls have reached the server
            m = httpx.get(f"{url.rsplit('/v1', 1)[0]}/metrics", headers={"Authorization": "Bearer k"}).json()
            seen = m["requests_running"]
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        rest, _ = p.communicate(timeout=60)
        log = "".join(lines) + rest
        assert p.returncode == 0, log
        assert len(results) == STREAMS
        ok = ("finished", "503 server_shutting_down", "error event server_shutting_down")
        bad = [r for r in results if r not in ok]
        assert bad == [], f"{bad}\n{log}"
        assert sum(r != "finished" for r in results) > 0, results  # the stop did cut calls
        assert "Traceback" not in log and "ERROR" not in log, log
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
