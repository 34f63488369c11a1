"""The four-line summary printed at the start of a run names the model's depth and width, also for a
vision-language config whose language model's sizes sit under text_config (Qwen2.5-VL printed '? layers')."""
from __future__ import annotations

from mtrain.config import load_config
from mtrain.run_output import summary


def test_summary_reads_a_flat_config():
    cfg = load_config(None, ["model.hf_path=/m", "data.task=arithmetic"])
    line = summary(cfg, {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64}, world=1).splitlines()[0]
    assert line == "mtrain: model llama (4 layers, hidden 64) from /m, " + cfg.model.dtype


def test_summary_reads_text_config_of_a_vision_language_model():
    cfg = load_config(None, ["model.hf_path=/m", "data.task=arithmetic"])
    hf = {"model_type": "qwen2_5_vl", "text_config": {"num_hidden_layers": 2, "hidden_size": 96},
          "vision_config": {"depth": 2, "hidden_size": 32}}
    assert summary(cfg, hf, world=1).startswith("mtrain: model qwen2_5_vl (2 layers, hidden 96) from /m")
