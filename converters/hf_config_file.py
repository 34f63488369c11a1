"""The keys every config.json a converter writes must carry for the engines that read it."""
from __future__ import annotations

import json
from pathlib import Path

from mtrain.models.hf_config import with_architectures


def complete_config_file(config_file: Path) -> None:
    """Add `architectures` (SGLang picks its model class by it) to a written config.json that lacks it: transformers'
    GGUF loader builds configs without it, and a hand-made config (make-fp8 --config) may omit it."""
    cfg = json.loads(config_file.read_text())
    full = with_architectures(cfg)
    if full is not cfg:
        config_file.write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
