# Make SGLang 0.5.17, megatron-core and mtrain importable on the GPU machine (no network there).
# Usage, from the repository root:   source benchmarks/gpu_setup.sh
# Needs in .gpu/ (git-ignored; carry it to the machine): sglang-0.5.17-device-py312-torch211.tar.xz
# (the bundle of /work/shared/device) and megatron_core-VERSION-cp312-*.whl, VERSION as setup.py pins it (BUILD.md
# has the download command; 0.19.2 needs torch >= 2.6). The machine's image brings
# Python 3.12, torch 2.11 (CUDA), triton, numpy, safetensors (/work/shared/device/README.md).
# Sourced, so: no `set -e` (it would leak into the caller's shell); errors `return 1`.

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "gpu_setup.sh must be sourced: source benchmarks/gpu_setup.sh" >&2
    exit 1
fi

_mt_setup() {
    local repo site bundle wheel py mcore
    repo=$(pwd)
    site=${MTRAIN_SITE:-/tmp/site}
    py=${PYTHON:-python3}
    bundle="$repo/.gpu/sglang-0.5.17-device-py312-torch211.tar.xz"
    if [ ! -f "$repo/mtrain/__init__.py" ]; then
        echo "gpu_setup.sh: run from the mtrain repository root (no mtrain/ in $repo)" >&2; return 1
    fi
    # The megatron-core version is declared once, in setup.py.
    mcore=$(grep -o 'megatron-core==[0-9][0-9.]*' "$repo/setup.py" | head -n 1 | cut -d= -f3)
    if [ -z "$mcore" ]; then
        echo "gpu_setup.sh: no megatron-core==VERSION pin found in $repo/setup.py" >&2; return 1
    fi
    wheel=$(ls "$repo"/.gpu/megatron_core-"$mcore"-cp312-*.whl 2>/dev/null | head -n 1)
    # The machine keeps /tmp while it stays warm, but folders carried with the repository do not reliably stay from
    # one call to the next: what is already unpacked is enough, and .gpu/ is needed only for what is missing.
    if [ ! -f "$site/.mtrain-sglang-bundle" ] && [ ! -f "$bundle" ]; then
        echo "gpu_setup.sh: SGLang is not unpacked in $site and $bundle is missing (carry .gpu/ to this machine)" >&2
        return 1
    fi
    if [ ! -d "$site/megatron_core-$mcore.dist-info" ] && [ -z "$wheel" ]; then
        echo "gpu_setup.sh: megatron-core $mcore is not in $site and .gpu/megatron_core-$mcore-cp312-*.whl is missing" >&2
        return 1
    fi
    # 1. SGLang runtime bundle (~5 s); a marker makes a second source on a warm machine free.
    if [ ! -f "$site/.mtrain-sglang-bundle" ]; then
        mkdir -p "$site" && tar -xJf "$bundle" -C "$site" && touch "$site/.mtrain-sglang-bundle" || {
            echo "gpu_setup.sh: unpacking $bundle into $site failed" >&2; return 1; }
    fi
    # 2. megatron-core, without dependencies (torch etc. come from the image / the bundle). A warm machine may
    #    hold another version from an older checkout: it is removed first (pip --target would keep it).
    if [ ! -d "$site/megatron_core-$mcore.dist-info" ]; then
        rm -rf "$site/megatron" "$site"/megatron_core-*.dist-info
        "$py" -m pip install -q --no-deps --no-index --no-compile --target "$site" "$wheel" || {
            echo "gpu_setup.sh: installing $wheel failed" >&2; return 1; }
    fi
    # 2b. Optional extra wheels, no dependencies: what SGLang's Qwen2.5-VL needs (torchvision, Pillow, einops: 14.7 MB)
    #     does not fit one 64 MiB carry together with .gpu/ (58 MB), so they live in a top-level .gpu-extra/ carried
    #     in a later call on the warm machine (BUILD.md, "GPU"); .gpu/extra/ is read too. A marker per wheel.
    #     Each into a folder of its own, then merged: `pip --target` skips a top-level folder the target has already
    #     (it warned "Target directory /tmp/site/bin already exists" and left py-spy's binary out, 2026-12-01).
    local extra tmp
    for extra in "$repo"/.gpu/extra/*.whl "$repo"/.gpu-extra/*.whl; do
        [ -f "$extra" ] || continue
        [ -f "$site/.mtrain-extra-$(basename "$extra")" ] && continue
        tmp=$(mktemp -d)
        "$py" -m pip install -q --no-deps --no-index --no-compile --target "$tmp" "$extra" && cp -a "$tmp"/. "$site"/ &&
            touch "$site/.mtrain-extra-$(basename "$extra")" || {
            rm -rf "$tmp"; echo "gpu_setup.sh: installing $extra failed" >&2; return 1; }
        rm -rf "$tmp"
    done
    # 3. mtrain from the checkout itself: mtrain/kernels and mtrain/converters are links to the top-level folders,
    #    so the checkout imports as the installed package does. SGLang's scheduler processes are spawned: they
    #    find mtrain's loader through this PYTHONPATH.
    export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
    export MTRAIN_REPO="$repo"
    # The cache in the machine's /tmp, where benchmarks/stage_smollm2.py joins the SmolLM2 GGUF: every script that
    # sources this finds it there (without it, run_gpu.sh's async and lora_sync went to fetch it, with no network)
    export MTRAIN_CACHE=${MTRAIN_CACHE:-/tmp/mtrain-cache}
    # From outside the checkout, so that the check does not depend on the working directory.
    (cd /tmp && "$py" - <<'EOF') || { echo "gpu_setup.sh: import check failed" >&2; return 1; }
import importlib, sys
for m in ("torch", "sglang", "megatron.core", "mtrain.rollout.sglang_loader", "mtrain.converters"):
    mod = importlib.import_module(m)
    print(f"gpu_setup: {m} {getattr(mod, '__version__', '')} from {mod.__file__}")
import torch
print(f"gpu_setup: python {sys.version.split()[0]}, cuda available={torch.cuda.is_available()}, "
      f"devices={torch.cuda.device_count()}")
EOF
}
_mt_setup
_mt_rc=$?
unset -f _mt_setup
return $_mt_rc
