"""`mtrain serve` as a real process: a tiny random Llama (character tokenizer), the real `openai` client, the key
from the environment, a clean stop on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from openai import OpenAI


def test_mtrain_serve_answers_and_stops_on_sigterm(tmp_path):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "mtrain", "init-tiny", "--arch", "llama", "--out", str(model)], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, MTRAIN_API_KEY="secret-test-key", CUDA_VISIBLE_DEVICES="")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model:\n  hf_path: {model}\n  dtype: float32\ndata:\n  task: arithmetic\n")
    p = subprocess.Popen([sys.executable, "-m", "mtrain", "serve", str(cfg), "serve.port=0", "serve.model_name=tiny",
                          "serve.default_max_tokens=8"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, url = [], None
        deadline = time.time() + 120
        while url is None and time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if " at http" in line:
                url = line.rsplit(" at ", 1)[1].strip()
        assert url, "".join(lines)
        assert any("API key: $MTRAIN_API_KEY" in x for x in lines + [p.stdout.readline()])
        c = OpenAI(base_url=url, api_key="secret-test-key", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+3="}])
        assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_api_key_source_reads_as_a_sentence(monkeypatch):
    # `mtrain serve: API key: SOURCE` (it read "API key from generated for this run")
    from mtrain.config import load_config
    from mtrain.serve.api_key import api_key_of
    cfg = load_config(None, ["model.hf_path=/m", "data.task=arithmetic"])
    monkeypatch.delenv(cfg.serve.api_key_env, raising=False)
    assert api_key_of(cfg) == (None, "none given (serve.api_key_env unset): a fresh one for this run, printed below")
    monkeypatch.setenv(cfg.serve.api_key_env, "k")
    assert api_key_of(cfg) == ("k", f"${cfg.serve.api_key_env}")
