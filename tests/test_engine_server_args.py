"""engine.server_args: SGLang engine arguments a run adds to mtrain's. From YAML and the command line, kept in the
dumped config, refused where mtrain decides the argument or nothing would read it, and unknown names refused with
the closest SGLang name (checked against the real ServerArgs field list when SGLang is installed, else a list)."""
import pytest
import yaml

from mtrain.config import ConfigError, load_config
from mtrain.engine_args import FIXED, FROM_CONFIG
from mtrain.rollout.sglang_preflight import unknown_server_args

BASE = ["model.hf_path=/models/tiny", "data.task=arithmetic"]


def test_from_yaml_and_command_line_and_round_trip(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"model": {"hf_path": "/m"}, "data": {"task": "arithmetic"},
                                 "engine": {"server_args": {"schedule_conservativeness": 0.5, "chunked_prefill_size": 4096}}}))
    cfg = load_config(p, ["engine.server_args.cuda_graph_max_bs_prefill=64",
                          "engine.server_args.enforce_disable_flashinfer_allreduce_fusion=false",
                          "engine.server_args.schedule_policy=lpm"])
    assert cfg.engine.server_args == {"schedule_conservativeness": 0.5, "chunked_prefill_size": 4096,
                                      "cuda_graph_max_bs_prefill": 64,
                                      "enforce_disable_flashinfer_allreduce_fusion": False, "schedule_policy": "lpm"}
    assert load_config(cfg.dump_yaml(tmp_path / "out" / "config.yaml")) == cfg  # what the run dir keeps
    # a whole mapping on the command line replaces the file's
    cfg = load_config(p, ["engine.server_args={max_running_requests: 8}"])
    assert cfg.engine.server_args == {"max_running_requests": 8}
    assert load_config(None, BASE).engine.server_args == {}  # default: nothing added


@pytest.mark.parametrize("override, message", [
    ("engine.server_args=[1, 2]", "engine.server_args: expected a mapping of names to values"),
    ("engine.server_args=7", "engine.server_args: expected a mapping"),
    ("engine.server_args.tp_size=2", "'tp_size' is set by engine.tp"),
    ("engine.server_args.dtype=float16", "'dtype' is set by model.dtype and engine.weight_dtype"),
    ("engine.server_args.quantization=fp8", "'quantization' is set by engine.weight_dtype"),
    ("engine.server_args.load_format=auto", "'load_format' is fixed by mtrain: engines start from dummy weights"),
    ("engine.server_args.moe_runner_backend=flashinfer_trtllm", "'moe_runner_backend' is fixed by mtrain"),
])
def test_refused_with_the_reason(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + [override])


def test_every_refused_name_is_refused_and_nothing_else():
    for name in list(FROM_CONFIG) + list(FIXED):
        with pytest.raises(ConfigError, match=f"engine.server_args: .*'{name}'"):
            load_config(None, BASE + [f"engine.server_args.{name}=1"])
    load_config(None, BASE + ["engine.server_args.schedule_policy=lpm"])


def test_nothing_reads_them_on_the_reference_engine():
    from mtrain.trainer.decisions import decide
    with pytest.raises(ConfigError, match="engine.server_args: applies to SGLang engines only"):
        load_config(None, BASE + ["engine.kind=reference", "engine.server_args.schedule_policy=lpm"])
    cfg = load_config(None, BASE + ["engine.server_args.schedule_policy=lpm"])  # kind=auto
    with pytest.raises(ConfigError, match="engine.server_args: applies to SGLang engines only.*CPU reference"):
        decide(cfg, world_size=1, local_world_size=1, cuda=False, te=False)
    assert decide(cfg, world_size=1, local_world_size=1, cuda=True, te=False).engine_kind == "sglang"


def _sglang_names():
    try:
        import dataclasses

        from sglang.srt.server_args import ServerArgs
        return [f.name for f in dataclasses.fields(ServerArgs)]
    except Exception:  # no SGLang on this machine: the names this test needs, from server_args.py of 0.5.17
        return ["disable_cuda_graph", "cuda_graph_max_bs", "chunked_prefill_size", "schedule_policy",
                "enforce_disable_flashinfer_allreduce_fusion", "max_running_requests", "tp_size"]


def test_unknown_names_are_refused_with_the_closest():
    names = _sglang_names()
    assert unknown_server_args({"disable_cuda_graph": False, "cuda_graph_max_bs": 8}, names) == []
    (msg,) = unknown_server_args({"disable_cuda_graphs": False}, names)
    assert msg == ("engine.server_args: SGLang has no server argument 'disable_cuda_graphs'; "
                   "did you mean 'disable_cuda_graph'?")
    (msg,) = unknown_server_args({"no_such_thing": 1}, names)
    assert msg == "engine.server_args: SGLang has no server argument 'no_such_thing'"


def test_the_trainer_passes_them_after_its_own(monkeypatch):
    """make_engine's SGLang branch: mtrain's arguments, then the run's (a recording stand-in for SGLangEngine: the
    real one needs a GPU; what is checked is the argument dict make_engine builds)."""
    import mtrain.rollout.sglang_engine as se
    from mtrain.trainer.decisions import decide
    from mtrain.trainer.engines import make_engine

    seen = {}

    class Recording:
        def __init__(self, path, **kw):
            seen.update(kw)

    monkeypatch.setattr(se, "SGLangEngine", Recording)
    cfg = load_config(None, BASE + ["engine.server_args.schedule_policy=lpm", "model.dtype=bfloat16"])
    d = decide(cfg, world_size=1, local_world_size=1, cuda=True, te=False)
    make_engine(cfg, __import__("pathlib").Path("/m"), {"architectures": ["LlamaForCausalLM"]}, d, 0)
    assert seen["server_args"]["dtype"] == "bfloat16" and seen["server_args"]["schedule_policy"] == "lpm"
    # production defaults: decode graphs on, captured up to the requests one engine runs at once (8 prompts x 4
    # samples by default), Triton attention where sgl_kernel has no FA3 (none here)
    assert seen["server_args"]["disable_cuda_graph"] is False
    assert seen["server_args"]["cuda_graph_max_bs_decode"] == 32
    assert seen["server_args"]["attention_backend"] == "triton"
    assert "enable_fp32_lm_head" not in seen["server_args"]
    seen.clear()
    cfg = load_config(None, BASE + ["engine.cuda_graphs=false", "model.dtype=bfloat16", "model.fp32_lm_head=true"])
    make_engine(cfg, __import__("pathlib").Path("/m"), {"architectures": ["LlamaForCausalLM"]}, d, 0)
    assert seen["server_args"]["disable_cuda_graph"] is True and "cuda_graph_max_bs_decode" not in seen["server_args"]
    assert seen["server_args"]["enable_fp32_lm_head"] is True


def test_bitwise_engine_is_started_on_mtrains_model_class():
    """numerics.on_policy=bitwise: SGLang builds mtrain's class for the architecture (an override merged with the
    run's own json_model_override_args); an architecture without one is refused in one line; the classes in
    mtrain/rollout/sglang_models/bitwise.py carry exactly the names the override gives (read from the source: SGLang
    does not import on a CPU)."""
    import ast
    import json
    from pathlib import Path

    from mtrain.rollout.protocol import EngineError
    from mtrain.rollout.sglang_wire import BITWISE_SERVED, bitwise_architecture, engine_server_args

    kw = dict(tp_size=1, mem_fraction_static=0.5, base_gpu_id=0, load_format="dummy", random_seed=0)
    args = engine_server_args("/m", architecture_override=bitwise_architecture("Qwen3ForCausalLM"), **kw)
    assert json.loads(args["json_model_override_args"]) == {"architectures": ["MtrainBitwiseQwen3ForCausalLM"]}
    args = engine_server_args("/m", architecture_override="MtrainBitwiseLlamaForCausalLM",
                              extra={"json_model_override_args": '{"rope_theta": 5.0}'}, **kw)
    assert json.loads(args["json_model_override_args"]) == {"rope_theta": 5.0,
                                                            "architectures": ["MtrainBitwiseLlamaForCausalLM"]}
    assert "json_model_override_args" not in engine_server_args("/m", **kw)
    with pytest.raises(EngineError, match="bitwise on SGLang serves .* this model is DeepseekV3ForCausalLM"):
        bitwise_architecture("DeepseekV3ForCausalLM")
    src = Path(__file__).resolve().parents[1] / "mtrain" / "rollout" / "sglang_models" / "bitwise.py"
    classes = {n.name for n in ast.parse(src.read_text()).body if isinstance(n, ast.ClassDef)
               and n.name.startswith("MtrainBitwise")}
    assert classes == {bitwise_architecture(a) for a in BITWISE_SERVED}
