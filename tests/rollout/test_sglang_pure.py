"""The SGLang side that runs without SGLang: environment hygiene, the engine-side loader, the adapter's
translations. The loader tests drive the real entry points (`load_direct`, `dump_params`) with a real
torch module whose parameter names follow SGLang's (`model.layers.N.self_attn.qkv_proj.weight`, ...)."""
import hashlib
import json
import os

import pytest
import torch

from mtrain.rollout.engine_env import engine_environment, torchrun_variables
from mtrain.rollout.protocol import EngineError, Request, SamplingParams
from mtrain.reshard import targets as T
from mtrain.rollout import sglang_loader as L

TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
                "ROLE_RANK": "3", "ROLE_NAME": "default", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0"}


# -- engine_env ------------------------------------------------------------------------------------------
def test_engine_environment_hides_torchrun_and_restores_everything():
    env = {"PATH": "/bin", "HOME": "/root", **TORCHRUN_ENV}
    before = dict(env)
    with engine_environment(extra={"MTRAIN_X": "1"}, environ=env) as removed:
        assert sorted(removed) == sorted(TORCHRUN_ENV)
        assert env == {"PATH": "/bin", "HOME": "/root", "MTRAIN_X": "1"}
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # what sglang.Engine writes for its children
        env["PATH"] = "/changed"
    assert env == before


def test_engine_environment_restores_os_environ_on_exception(monkeypatch):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="engine failed"):
        with engine_environment():
            assert torchrun_variables(os.environ) == []
            os.environ["NCCL_CUMEM_ENABLE"] = "0"
            raise RuntimeError("engine failed")
    assert dict(os.environ) == before


def test_engine_environment_rejects_non_string_extra_and_restores():
    env = dict(TORCHRUN_ENV)
    with pytest.raises(TypeError, match="MTRAIN_BAD"):
        with engine_environment(extra={"MTRAIN_BAD": 1}, environ=env):
            pass
    assert env == TORCHRUN_ENV


# -- the engine-side loader ------------------------------------------------------------------------------
class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(8, 16, bias=True, dtype=torch.bfloat16)
        self.kv_b_proj = torch.nn.Linear(4, 6, bias=False, dtype=torch.bfloat16)


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 6, 8, dtype=torch.bfloat16), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(4, 8, 3, dtype=torch.bfloat16), requires_grad=False)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = torch.nn.Module()
        self.mlp.experts = _Experts()
        self.mlp.gate = torch.nn.Module()
        self.mlp.gate.e_score_correction_bias = torch.nn.Parameter(torch.zeros(4), requires_grad=False)


class TinySGLangLikeModel(torch.nn.Module):
    """Parameter names as SGLang's DeepSeek/Qwen3-MoE classes have them; post_load_weights like DeepSeek's."""

    def __init__(self, with_weight_names=True):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.hook_calls = []
        self.with_weight_names = with_weight_names

    def post_load_weights(self, is_nextn=False, weight_names=None):
        self.hook_calls.append(weight_names)


class PlainHookModel(TinySGLangLikeModel):
    def post_load_weights(self):  # the other hook shape SGLang's loaders call (no arguments)
        self.hook_calls.append("called")


@pytest.fixture
def status_dir(tmp_path, monkeypatch):
    d = tmp_path / "status"
    d.mkdir()
    monkeypatch.setenv(L.STATUS_DIR_ENV, str(d))
    L._touched_since_finish.clear()
    yield str(d)
    L._touched_since_finish.clear()


def _params(model):
    return dict(model.named_parameters())


def test_parse_target_forms_and_errors():
    assert T.parse_target("model.a.weight") == T.Target("model.a.weight")
    assert T.parse_target("model.a.w13_weight@2:4") == T.Target("model.a.w13_weight", 2, 4)
    for bad, msg in [("p@4:2", "stop 2 must exceed start 4"), ("p@1:", "expected"), ("", "expected"),
                     (3, "must be a str")]:
        with pytest.raises(T.LoaderError, match=msg):
            T.parse_target(bad)


def test_load_direct_writes_whole_params_and_expert_rows(status_dir):
    m = TinySGLangLikeModel()
    qkv = torch.randn(16, 8).to(torch.bfloat16)
    experts = torch.randn(2, 6, 8).to(torch.bfloat16)
    bias = torch.randn(4)  # e_score_correction_bias stays fp32 in SGLang
    L.load_direct(m, [("model.layers.1.self_attn.qkv_proj.weight", qkv),
                      ("model.layers.0.mlp.experts.w13_weight@1:3", experts),
                      ("model.layers.0.mlp.gate.e_score_correction_bias", bias)])
    assert L.collect_errors(status_dir) == []
    p = _params(m)
    assert torch.equal(p["model.layers.1.self_attn.qkv_proj.weight"], qkv)
    w13 = p["model.layers.0.mlp.experts.w13_weight"]
    assert torch.equal(w13[1:3], experts) and not w13[0].any() and not w13[3].any()
    assert torch.equal(p["model.layers.0.mlp.gate.e_score_correction_bias"], bias)


@pytest.mark.parametrize("entry, message", [
    (("model.layers.0.self_attn.qkv_prj.weight", torch.zeros(16, 8, dtype=torch.bfloat16)),
     r"no parameter 'model.layers.0.self_attn.qkv_prj.weight'.*closest: \['model.layers.0.self_attn.qkv_proj"),
    (("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(16, 4, dtype=torch.bfloat16)),
     r"shape \(16, 4\) does not match model.layers.0.self_attn.qkv_proj.weight shape \(16, 8\)"),
    (("model.layers.0.self_attn.qkv_proj.bias", torch.zeros(16, dtype=torch.float32)),
     r"dtype torch.float32 does not match model.layers.0.self_attn.qkv_proj.bias dtype torch.bfloat16"),
    (("model.layers.0.mlp.experts.w2_weight@3:5", torch.zeros(2, 8, 3, dtype=torch.bfloat16)),
     r"rows \[3, 5\) out of range for model.layers.0.mlp.experts.w2_weight with 4 rows"),
    (("model.layers.0.mlp.experts.w2_weight@0:2", torch.zeros(1, 8, 3, dtype=torch.bfloat16)),
     r"shape \(1, 8, 3\) does not match model.layers.0.mlp.experts.w2_weight\[0:2\] shape \(2, 8, 3\)"),
    (("model.layers.0.mlp.experts.w2_weight", [1, 2]), "expected a torch.Tensor"),
])
def test_bad_bucket_is_reported_and_nothing_is_written(status_dir, entry, message):
    m = TinySGLangLikeModel()
    before = {k: v.clone() for k, v in _params(m).items()}
    good = ("model.layers.1.self_attn.kv_b_proj.weight", torch.ones(6, 4, dtype=torch.bfloat16))
    L.load_direct(m, [good, entry])  # must not raise: a raise in a scheduler kills the training process
    errors = L.collect_errors(status_dir)
    assert len(errors) == 1 and "LoaderError" in errors[0]
    assert __import__("re").search(message, errors[0]), errors[0]
    assert all(torch.equal(before[k], v) for k, v in _params(m).items())  # the good entry was not written
    assert L.collect_errors(status_dir) == []  # read once, then gone
    assert L._touched_since_finish == set()


def test_overlapping_rows_in_one_bucket_are_rejected():
    m = TinySGLangLikeModel()
    t = torch.zeros(2, 6, 8, dtype=torch.bfloat16)
    with pytest.raises(L.LoaderError, match=r"rows \[1, 3\) of model.layers.0.mlp.experts.w13_weight are written "
                                            r"twice in one bucket \(also \[0, 2\)\)"):
        L.plan_copies(_params(m), [("model.layers.0.mlp.experts.w13_weight@0:2", t),
                                   ("model.layers.0.mlp.experts.w13_weight@1:3", t)])


def test_finish_runs_post_load_hook_with_touched_kv_b_proj_names(status_dir):
    m = TinySGLangLikeModel()
    kvb = torch.randn(6, 4).to(torch.bfloat16)
    L.load_direct(m, [("model.layers.1.self_attn.kv_b_proj.weight", kvb)])
    L.load_direct(m, [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(16, 8, dtype=torch.bfloat16))])
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0))])
    assert m.hook_calls == [["model.layers.1.self_attn.kv_b_proj.weight"]]
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0))])  # nothing touched since: DeepSeek-style hook skipped
    assert m.hook_calls == [["model.layers.1.self_attn.kv_b_proj.weight"]]
    plain = PlainHookModel()
    L.load_direct(plain, [(L.FINISH_NAME, torch.empty(0))])
    assert plain.hook_calls == ["called"]
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0)), ("model.layers.0.self_attn.kv_b_proj.weight", kvb)])
    assert "must be sent alone" in L.collect_errors(status_dir)[0]


class _Fp8RadixAttention(torch.nn.Module):
    """The k/v scale attributes an FP8 engine's RadixAttention carries (layers/quantization/kv_cache.py:41-48 and
    :93-96): float32 scalar parameters plus the Python floats the attention kernels read."""

    def __init__(self, k: float, v: float):
        super().__init__()
        self.k_scale = torch.nn.Parameter(torch.tensor(k), requires_grad=False)
        self.v_scale = torch.nn.Parameter(torch.tensor(v), requires_grad=False)
        self.k_scale_float, self.v_scale_float = k, v


def test_finish_resets_kv_scales_of_fp8_attention_layers(status_dir):
    """After a weights release the parameters hold garbage and after a dummy load the floats hold a value derived
    from random weights; every sync's end leaves both at 1.0 (a checkpoint without KV scales). Layers of a bf16
    engine (k_scale None) are left alone."""
    m = TinySGLangLikeModel()
    m.model.layers[0].self_attn.attn = _Fp8RadixAttention(4.2e-4, 4.2e-4)  # a positive dummy value became the scale
    m.model.layers[1].self_attn.attn = _Fp8RadixAttention(1.0, 1.0)
    m.model.layers[1].self_attn.attn.k_scale.data.fill_(float("nan"))  # released and resumed: garbage
    plain = torch.nn.Module()
    plain.k_scale, plain.v_scale, plain.k_scale_float = None, None, None  # a bf16 engine's RadixAttention
    m.model.layers[1].self_attn.attn_bf16 = plain
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0))])
    assert L.collect_errors(status_dir) == []
    for layer in m.model.layers:
        a = layer.self_attn.attn
        assert a.k_scale.item() == 1.0 and a.v_scale.item() == 1.0
        assert (a.k_scale_float, a.v_scale_float) == (1.0, 1.0)
        assert a.k_scale.dtype == torch.float32 and a.k_scale.dim() == 0
    assert plain.k_scale is None and plain.k_scale_float is None
    assert L.reset_kv_scales(m) == 2


def test_fp8_engine_whose_graphs_captured_dummy_kv_scales_is_refused_at_first_sync(status_dir, monkeypatch):
    """With decode CUDA graphs the start's KV-scale floats are kernel arguments no sync can change: attention layers
    that hold the dummy-derived value make the first sync fail with one clear message, nothing else done, and the
    scales are left as they were (the run stops there). Layers already at 1.0 (a model without KV-scale
    attention has none at all: Qwen3-MoE) pass, and without graphs the same model is reset as before."""
    monkeypatch.setattr(L, "cuda_graphs_on", lambda: True)
    m = TinySGLangLikeModel()
    m.model.layers[0].self_attn.attn = _Fp8RadixAttention(4.2e-4, 4.2e-4)
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0))])
    (err,) = L.collect_errors(status_dir)
    assert "captured CUDA graphs with KV scales" in err and "0.00042 in 1 attention layers" in err
    assert "engine.cuda_graphs=false" in err
    assert m.model.layers[0].self_attn.attn.k_scale_float == 4.2e-4
    ok = TinySGLangLikeModel()
    ok.model.layers[0].self_attn.attn = _Fp8RadixAttention(1.0, 1.0)
    L.load_direct(ok, [(L.FINISH_NAME, torch.empty(0))])
    L.load_direct(TinySGLangLikeModel(), [(L.FINISH_NAME, torch.empty(0))])  # no KV-scale layers
    assert L.collect_errors(status_dir) == []
    monkeypatch.setattr(L, "cuda_graphs_on", lambda: False)
    L.load_direct(m, [(L.FINISH_NAME, torch.empty(0))])
    assert L.collect_errors(status_dir) == [] and m.model.layers[0].self_attn.attn.k_scale_float == 1.0
    L.check_graph_kv_scales([], True)  # no KV-scale layers: nothing to refuse


def test_cuda_graphs_are_off_without_sglang():
    """On the CPU box (no SGLang) and outside a scheduler, `cuda_graphs_on` says no graphs rather than failing."""
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        assert L.cuda_graphs_on() is False


def test_dump_params_checksums_and_tensors(status_dir, tmp_path):
    m = TinySGLangLikeModel()
    qkv = torch.randn(16, 8).to(torch.bfloat16)
    L.load_direct(m, [("model.layers.0.self_attn.qkv_proj.weight", qkv)])
    out = tmp_path / "dump"
    spec = {"dir": str(out), "names": None, "what": "sha256"}
    L.dump_params(m, [(L.DUMP_PREFIX + json.dumps(spec), torch.empty(0))])
    assert L.collect_errors(status_dir) == []
    sums = json.loads((out / "rank0.json").read_text())
    assert set(sums) == set(_params(m))
    raw = qkv.contiguous().view(torch.uint8).numpy().tobytes()
    assert sums["model.layers.0.self_attn.qkv_proj.weight"] == {
        "shape": [16, 8], "dtype": "bfloat16", "sha256": hashlib.sha256(raw).hexdigest()}
    spec = {"dir": str(out), "names": ["model.layers.0.self_attn.qkv_proj.weight"], "what": "tensors"}
    L.dump_params(m, [(L.DUMP_PREFIX + json.dumps(spec), torch.empty(0))])
    saved = torch.load(out / "rank0.pt")
    assert list(saved) == ["model.layers.0.self_attn.qkv_proj.weight"] and torch.equal(saved[list(saved)[0]], qkv)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize("name, message", [
    (L.DUMP_PREFIX + json.dumps({"dir": "/tmp/x", "names": ["model.nope"]}), "no parameter 'model.nope'"),
    (L.DUMP_PREFIX + "{not json", "bad JSON spec"),
    (L.DUMP_PREFIX + json.dumps({"dir": "/tmp/x", "what": "md5"}), "'what' must be"),
    ("model.layers.0.self_attn.qkv_proj.weight", "expects exactly one"),
])
def test_dump_params_bad_spec_is_reported(status_dir, name, message):
    L.dump_params(TinySGLangLikeModel(), [(name, torch.empty(0))])
    errors = L.collect_errors(status_dir)
    assert len(errors) == 1 and message in errors[0], errors


# -- the adapter without sglang --------------------------------------------------------------------------
def test_adapter_imports_without_sglang_and_fails_clearly():
    import importlib.util

    from mtrain.rollout.sglang_engine import SGLangEngine

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(EngineError, match=r"SGLangEngine needs sglang 0\.5\.17.*importing it failed"):
        SGLangEngine("/nonexistent/model")


def test_engine_server_args_pin_the_layout_the_loader_assumes():
    from mtrain.rollout.sglang_engine import engine_server_args

    args = engine_server_args("/m", tp_size=2, mem_fraction_static=0.3, base_gpu_id=1, load_format="dummy",
                              random_seed=7, extra={"custom_weight_loader": ["pkg.mod.fn"], "log_level": "info"})
    from mtrain.rollout.sglang_taps import TAP_ACTIVATIONS
    assert args["custom_weight_loader"] == [L.LOAD_DIRECT, L.DUMP_PARAMS, TAP_ACTIVATIONS, "pkg.mod.fn"]
    assert (args["moe_runner_backend"], args["disable_shared_experts_fusion"], args["skip_tokenizer_init"],
            args["enable_memory_saver"], args["cuda_graph_backend_prefill"], args["weight_version"],
            args["mm_attention_backend"]) == ("triton", True, True, True, "disabled", "0", "triton_attn")
    assert (args["tp_size"], args["base_gpu_id"], args["load_format"], args["log_level"]) == (2, 1, "dummy", "info")
    # no nvcc build of flashinfer's all-reduce fusion at a DeepSeek engine's first start, unless asked for
    assert args["enforce_disable_flashinfer_allreduce_fusion"] is True
    assert engine_server_args("/m", tp_size=2, mem_fraction_static=0.3, base_gpu_id=0, load_format="dummy",
                              random_seed=7, extra={"enforce_disable_flashinfer_allreduce_fusion": False}
                              )["enforce_disable_flashinfer_allreduce_fusion"] is False


def test_sampling_params_translation():
    from mtrain.rollout.sglang_engine import to_sglang_sampling

    assert to_sglang_sampling(SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(2, 7)), 11) == {
        "max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 11,
        "stop_token_ids": [2, 7]}
    no_stop = to_sglang_sampling(SamplingParams(), 0)
    assert "stop_token_ids" not in no_stop and no_stop["ignore_eos"] is True  # only the length limit stops


def _out(ids, lps, reason, version="3"):
    return {"output_ids": ids, "meta_info": {"finish_reason": reason, "weight_version": version,
                                             "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, ids)]}}


def test_completion_from_sglang_output():
    from mtrain.rollout.sglang_engine import completion_from_output

    req = Request("r-0-", [1, 2], SamplingParams())
    c = completion_from_output(req, _out([5, 2], [-0.5, -1.25], {"type": "stop", "matched": 2}), 0)
    assert (c.output_ids, c.logprobs, c.finish_reason, c.weight_version) == ([5, 2], [-0.5, -1.25], "stop", 3)
    c = completion_from_output(req, _out([5], [-0.5], {"type": "abort", "message": "x"}), 0)
    assert c.finish_reason == "abort"
    with pytest.raises(EngineError, match="2 output ids but 1 logprobs"):
        completion_from_output(req, {"output_ids": [5, 6], "meta_info": {
            "finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 5, None)]}}, 0)
    with pytest.raises(EngineError, match="unexpected SGLang finish_reason"):
        completion_from_output(req, _out([5], [-0.5], None), 0)
    with pytest.raises(EngineError, match="weight_version 'default' is not an int"):
        completion_from_output(req, _out([5], [-0.5], {"type": "length"}, "default"), 0)


def test_top_logprobs_from_sglang_output():
    """meta_info["output_top_logprobs"] as tokenizer_manager.detokenize_top_logprobs_tokens builds it with
    skip_tokenizer_init: per position a list of (logprob, token_id, None) (SGLANG-APIS.md section 6)."""
    from mtrain.rollout.sglang_engine import completion_from_output

    req = Request("r-0-", [1, 2], SamplingParams(top_logprobs=2))
    out = _out([5, 2], [-0.5, -1.25], {"type": "length"})
    out["meta_info"]["output_top_logprobs"] = [[(-0.5, 5, None), (-1.5, 9, None)],
                                               [(-2.5, 7, None), (-0.25, 4, None), (-1.25, 2, None)]]
    c = completion_from_output(req, out, 0)
    assert c.top_logprobs == [[(5, -0.5), (9, -1.5)], [(4, -0.25), (2, -1.25)]]  # most likely first, k kept
    assert completion_from_output(Request("r-1-", [1], SamplingParams()), _out([5], [-0.5], {"type": "length"}),
                                  0).top_logprobs is None
    out["meta_info"]["output_top_logprobs"] = [[(-0.5, 5, None), (-1.5, 9, None)], None]
    with pytest.raises(EngineError, match="asked for 2 top logprobs per token"):
        completion_from_output(req, out, 0)
