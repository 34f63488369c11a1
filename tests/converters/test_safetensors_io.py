"""safetensors_io: round trips, and every bad input gives one CheckpointError naming the file and tensor."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.converters.errors import CheckpointError, OutputExistsError, TensorMismatchError
from mtrain.converters.safetensors_io import (
    INDEX_FILE, SINGLE_FILE, HFCheckpoint, ShardedWriter, atomic_output_dir, check_tensor,
)


def random_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g, dtype=torch.float64),
        "positions": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
    }


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> Path:
    with ShardedWriter(out, max_shard_bytes=max_shard_bytes) as writer:
        (writer.path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        for name, t in tensors.items():
            writer.add(name, t)
    return out


@pytest.fixture
def sharded(tmp_path) -> Path:
    # 1 KiB shards: [embedding (4 KiB, over the cap: alone)] [q] [up] [the small rest] = 4 shards.
    return write_checkpoint(tmp_path / "ckpt", random_tensors(), max_shard_bytes=1024)


def test_round_trip_sharded(sharded):
    tensors = random_tensors()
    index = json.loads((sharded / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not list(sharded.parent.glob("*.tmp-*"))

    ckpt = HFCheckpoint(sharded)
    assert ckpt.config == {"model_type": "llama"}
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, expected in tensors.items():
        assert ckpt.shape(name) == tuple(expected.shape)
        assert ckpt.dtype(name) == expected.dtype
        got = ckpt.get(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert dict(ckpt.items()).keys() == tensors.keys()


def test_round_trip_single_file(tmp_path):
    tensors = random_tensors()
    out = write_checkpoint(tmp_path / "one", tensors, max_shard_bytes=1 << 30)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]
    ckpt = HFCheckpoint(out)
    for name, expected in tensors.items():
        assert torch.equal(ckpt.get(name), expected), name


def test_bf16_bits_preserved(tmp_path):
    # every bf16 bit pattern that is a finite number survives the round trip bit for bit
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    t = t[torch.isfinite(t)]
    out = write_checkpoint(tmp_path / "bf16", {"w": t}, max_shard_bytes=1 << 20)
    assert torch.equal(HFCheckpoint(out).get("w").view(torch.int16), t.view(torch.int16))


def test_truncated_shard(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard = sharded / index["weight_map"]["model.embed_tokens.weight"]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"truncated file.*tensor 'model.embed_tokens.weight'") as e:
        HFCheckpoint(sharded)
    assert str(shard) in str(e.value)


def test_file_shorter_than_header(sharded):
    shard = sharded / "model-00001-of-00004.safetensors"
    os.truncate(shard, 20)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004.safetensors: corrupt or truncated header"):
        HFCheckpoint(sharded)


def test_corrupt_header_json(sharded):
    shard = sharded / "model-00002-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\x00{["  # the header starts right after its 8-byte length
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00004.safetensors: corrupt safetensors header"):
        HFCheckpoint(sharded)


def test_header_entry_inconsistent(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    (tmp_path / SINGLE_FILE).write_bytes(struct.pack("<Q", len(header)) + header + bytes(60))
    with pytest.raises(CheckpointError, match=r"tensor 'w': offsets \[0, 60\) do not hold F32\[4, 4\] \(64 bytes\)"):
        HFCheckpoint(tmp_path)


def test_missing_shard(sharded):
    (sharded / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard file .*model-00003-of-00004.safetensors \(holding tensor '.+'\) does not exist"):
        HFCheckpoint(sharded)


def test_tensor_missing_from_shard(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.0.self_attn.k_proj.weight"] = "model-00001-of-00004.safetensors"
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
                       r"is listed in model.safetensors.index.json but absent from this shard"):
        HFCheckpoint(sharded)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: missing"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither model.safetensors nor model.safetensors.index.json exists "
                       r"\(found \['model-00001-of-00002.safetensors'\]"):
        HFCheckpoint(tmp_path)


def test_unknown_tensor_name(sharded):
    with pytest.raises(CheckpointError, match=r"no tensor named 'lm_head.weight'"):
        HFCheckpoint(sharded).get("lm_head.weight")


def test_check_tensor():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    check_tensor("ok", t, (3, 4), torch.bfloat16)
    with pytest.raises(TensorMismatchError, match=r"tensor 'layers.0.w': shape \[3, 4\] does not match the expected \[4, 3\]"):
        check_tensor("layers.0.w", t, (4, 3), torch.bfloat16)
    with pytest.raises(TensorMismatchError, match=r"tensor 'layers.0.w': dtype torch.bfloat16 does not match the expected torch.float32"):
        check_tensor("layers.0.w", t, (3, 4), torch.float32)


@pytest.mark.parametrize("marker", ["config.json", "model.safetensors", "metadata.json", "common.pt"])
def test_existing_checkpoint_refused(tmp_path, marker):
    out = tmp_path / "out"
    out.mkdir()
    (out / marker).write_text("old")
    with pytest.raises(OutputExistsError, match=rf"refusing to write into .*out: it already holds a checkpoint \({marker}\); pass --force"):
        ShardedWriter(out)
    assert (out / marker).read_text() == "old"
    assert not list(tmp_path.glob("out.tmp-*"))


def test_overwrite_replaces_checkpoint(sharded):
    (sharded / "stale.txt").write_text("from the old checkpoint")
    new_tensors = {"x": torch.ones(2)}
    with ShardedWriter(sharded, overwrite=True) as writer:
        (writer.path / "config.json").write_text("{}")
        for name, t in new_tensors.items():
            writer.add(name, t)
        assert HFCheckpoint(sharded).names()  # the old checkpoint is intact until commit
    assert sorted(p.name for p in sharded.iterdir()) == ["config.json", SINGLE_FILE]
    assert HFCheckpoint(sharded).names() == ["x"]
    assert not [p for p in sharded.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_non_checkpoint_dir_refused_even_with_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"non-empty directory that does not hold a checkpoint"):
        ShardedWriter(tmp_path, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with ShardedWriter(empty) as writer:  # an empty directory is fine
        writer.add("x", torch.ones(1))
    assert (empty / SINGLE_FILE).is_file()


def test_exception_mid_write_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedWriter(out, max_shard_bytes=64) as writer:
            writer.add("a", torch.ones(16))
            writer.add("b", torch.ones(16))  # flushes shard 1 to disk
            assert list(writer.path.glob("*.partial"))
            raise RuntimeError("boom")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir(tmp_path):
    out = tmp_path / "mcore"
    with pytest.raises(KeyError):
        with atomic_output_dir(out) as tmp:
            (tmp / "common.pt").write_text("partial")
            raise KeyError("crash")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(out) as tmp:
        (tmp / "common.pt").write_text("done")
        assert not out.exists()
    assert (out / "common.pt").read_text() == "done"
    with pytest.raises(OutputExistsError, match=r"already holds a checkpoint \(common.pt\)"):
        with atomic_output_dir(out):
            pass


def test_killed_process_leaves_no_output(tmp_path):
    # A real crash: the writing process dies (no exception handling runs) after a shard is on disk.
    out = tmp_path / "out"
    script = (
        "import os, torch\n"
        "from mtrain.converters.safetensors_io import ShardedWriter\n"
        f"w = ShardedWriter({str(out)!r}, max_shard_bytes=64)\n"
        "w.add('a', torch.ones(16)); w.add('b', torch.ones(16))\n"
        "os._exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0].name  # staging only: never read as a checkpoint
    with ShardedWriter(out) as writer:  # and the next run is not blocked by it
        writer.add("a", torch.ones(1))
    assert (out / SINGLE_FILE).is_file()


def test_duplicate_tensor_name(tmp_path):
    writer = ShardedWriter(tmp_path / "out")
    writer.add("a", torch.ones(1))
    with pytest.raises(ValueError, match=r"tensor 'a' was already written"):
        writer.add("a", torch.ones(1))
    writer.abort()
    assert list(tmp_path.iterdir()) == []
