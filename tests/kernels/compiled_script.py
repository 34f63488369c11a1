"""Run one of this folder's scripts in a subprocess with Triton compiling for the GPU (TRITON_INTERPRET=0: the
test session itself runs interpreted), and check that it printed its success line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_compiled(script: str, success: str, timeout: int = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(HERE / script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert success in proc.stdout, proc.stdout
