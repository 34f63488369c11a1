"""mtrain-convert: known errors are one line on stderr and exit 2; subcommands import lazily."""
import subprocess
import sys

import pytest

from mtrain.converters import __main__ as cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_gguf_missing_file(capsys, tmp_path):
    missing = tmp_path / "nope.gguf"
    code, out, err = run_cli(capsys, "gguf-to-hf", "--gguf", str(missing), "--out", str(tmp_path / "hf"))
    assert code == 2
    assert err.splitlines() == [f"mtrain-convert: error: GGUF file {missing} does not exist"]
    assert not (tmp_path / "hf").exists()


def test_gguf_corrupt_file(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)
    code, _, err = run_cli(capsys, "gguf-to-hf", "--gguf", str(bad), "--out", str(tmp_path / "hf"))
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"mtrain-convert: error: {bad}: not a readable GGUF file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_existing_output_refused_before_work(capsys, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not even read: the output is checked first")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "gguf-to-hf", "--gguf", str(gguf), "--out", str(out))
    assert code == 2
    assert err.splitlines() == [
        f"mtrain-convert: error: refusing to write into {out}: it already holds a checkpoint (config.json); "
        "pass --force (overwrite=True) to replace it"
    ]
    assert (out / "config.json").read_text() == "{}"


def test_missing_subcommand_module(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "verify", "not_written_yet")
    code, _, err = run_cli(capsys, "verify", "--hf", "a", "--mcore", "b")
    assert code == 2
    assert err.splitlines() == [
        "mtrain-convert: error: subcommand 'verify' is not available: "
        "mtrain.converters.not_written_yet is not part of this install"
    ]


def test_usage_errors_are_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["hf-to-mcore", "--hf", "x", "--out", "y", "--tp", "0"])
    assert e.value.code == 2 and "--tp: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["gguf-to-hf", "--gguf", "x", "--out", "y", "--dtype", "int3"])
    assert e.value.code == 2 and "unknown dtype 'int3'" in capsys.readouterr().err


def test_parser_covers_every_subcommand():
    import torch

    parser = cli.build_parser()
    args = parser.parse_args(["hf-to-mcore", "--hf", "h", "--out", "o", "--tp", "2", "--ep", "4", "--etp", "1",
                              "--dtype", "bf16", "--force"])
    assert (args.tp, args.pp, args.ep, args.etp, args.dtype, args.force) == (2, 1, 4, 1, torch.bfloat16, True)
    args = parser.parse_args(["mcore-to-hf", "--mcore", "m", "--out", "o", "--hf-config", "h"])
    assert (args.mcore, args.out, args.hf_config, args.force) == ("m", "o", "h", False)
    args = parser.parse_args(["verify", "--hf", "h", "--mcore", "m", "--pp", "2", "--tol", "1e-5"])
    assert (args.tp, args.pp, args.ep, args.tol) == (1, 2, 1, 1e-5)
    args = parser.parse_args(["mcore-to-sglang", "--mcore", "m", "--engine-tp", "4", "--out", "o"])
    assert (args.engine_tp, args.engine_ep) == (4, 1)
    args = parser.parse_args(["hf-to-mcore", "--hf", "h", "--out", "o", "--pp", "16", "--first-stage-layers", "3",
                              "--last-stage-layers", "2"])
    assert (args.pp, args.first_stage_layers, args.last_stage_layers) == (16, 3, 2)
    args = parser.parse_args(["verify", "--hf", "h", "--mcore", "m", "--pp", "2", "--first-stage-layers", "1"])
    assert (args.first_stage_layers, args.last_stage_layers) == (1, None)
    args = parser.parse_args(["make-fp8", "--config", "c.json", "--out", "o", "--block", "64"])
    assert (args.config, args.hf, args.block, args.seed, args.shard_gb) == ("c.json", None, 64, 0, 1.0)
    args = parser.parse_args(["export-lora", "--mcore", "m", "--hf", "h", "--out", "o", "--merge"])
    assert (args.mcore, args.hf, args.out, args.merge, args.force) == ("m", "h", "o", True, False)
    assert set(cli.SUBCOMMANDS) == {"hf-to-mcore", "mcore-to-hf", "gguf-to-hf", "verify", "mcore-to-sglang",
                                    "make-fp8", "export-lora"}


def test_python_dash_m_entry(tmp_path):
    # the real entry point in a fresh interpreter: one line on stderr, exit 2, no traceback
    proc = subprocess.run(
        [sys.executable, "-m", "mtrain.converters", "gguf-to-hf", "--gguf", str(tmp_path / "x.gguf"),
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"mtrain-convert: error: GGUF file {tmp_path / 'x.gguf'} does not exist"]


def test_gguf_unsupported_architecture(capsys, tmp_path):
    import gguf

    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, _, err = run_cli(capsys, "gguf-to-hf", "--gguf", str(path), "--out", str(tmp_path / "hf"))
    assert code == 2
    assert err.splitlines() == [
        f"mtrain-convert: error: {path}: GGUF architecture 'bloom' is not supported by gguf_to_hf "
        "(supported: llama, qwen2, qwen3)"
    ]
