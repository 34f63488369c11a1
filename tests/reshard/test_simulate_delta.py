"""The delta-sync price on the simulator's plan (mtrain/reshard/simulate_delta.py): the wire share from the delta
encoding's own break-even (int32 index + bf16 value per changed element, whole buffer when not smaller), link times
re-priced by hand for one GPU, and the CLI on a tiny model."""
import pytest

from mtrain.reshard.simulate import Hardware, RankStats, SimulationError
from mtrain.reshard.simulate_delta import delta_link_times, main, wire_share


def test_wire_share_follows_the_encoding_break_even():
    assert wire_share(0.0) == 0.0
    assert wire_share(0.01) == pytest.approx(0.03)  # (4 + 2) / 2 bytes per changed element over 2 per element
    assert wire_share(1 / 3) == pytest.approx(1.0)  # the delta executor's break-even for bf16 with int32 indices
    assert wire_share(0.5) == 1.0  # denser: the whole buffer travels
    with pytest.raises(SimulationError, match="not a fraction"):
        wire_share(1.5)


def test_one_gpu_re_priced_by_hand():
    hw = Hardware(hbm_bw=1e12, nvlink_bw=1e11, ib_bw=1e10, launch_s=0.0, per_bucket_s=0.0)
    s = RankStats(local=10**9, sent_ib=4 * 10**9, recv_ib=2 * 10**9, sent_nvlink=10**9, recv_nvlink=3 * 10**9)
    t = delta_link_times(s, hw, 0.02)
    w = 0.06
    assert t["ib"] == pytest.approx(w * 4e9 / 1e10)
    assert t["nvlink"] == pytest.approx(w * 3e9 / 1e11)
    # pack 2 + compare 2 + DMA w per sent byte; DMA w + mirror copy 2 + unpack 2 per received byte; local 2
    assert t["hbm"] == pytest.approx((2 * 1e9 + (4 + w) * 5e9 + (4 + w) * 5e9) / 1e12)
    assert t["overlap"] == pytest.approx(max(t["hbm"], t["ib"], t["nvlink"]))


def test_cli_on_a_tiny_model(tmp_path, capsys):
    import json

    from mtrain.tiny_configs import tiny_config
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config("deepseek_v3")))
    assert main(["--config", str(cfg), "--train", "tp=1,pp=2,ep=2", "--world", "4", "--engine", "tp=2,ep=2",
                 "--changed", "0.01,0.5"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "1.0 %" in out and "50.0 %" in out
    assert main(["--config", str(cfg), "--changed", "2"]) == 2
    assert "not a fraction" in capsys.readouterr().err
