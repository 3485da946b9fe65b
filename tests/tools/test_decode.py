"""`ubep decode`: a short run on 2 ranks gives one row per system, the same greedy tokens under
every system, and the JSON and the plot it was asked for."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from ubep.bench.decode import DecodeConfig
from ubep.cli import main


def test_decode_command_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "decode.json", tmp_path / "decode.png"
    argv = ["decode", "--ranks", "2", "--batch", "2", "--prompt", "3", "--steps", "2", "--warmup", "1"]
    argv += ["--repeats", "1", "--hidden", "128", "--experts", "4", "--topk", "2"]
    argv += ["--systems", "ubep,bsp,all_to_all", "--json", str(out_json), "--plot", str(out_png)]
    argv += ["--trace", str(tmp_path / "trace.json")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "ms/token" in printed and "all_to_all" in printed
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["system"] for r in rows] == ["ubep", "bsp", "all_to_all"]
    for r in rows:
        assert r["same_tokens"] is True, f"{r['system']} decoded other tokens than ubep"
        assert r["ms_per_token"] > 0 and 0 < r["comm_share"] < 1
        assert abs(r["tokens_per_s"] - 2 * 2 / (r["ms_per_token"] / 1e3)) < 1e-6 * r["tokens_per_s"]
    assert out_png.stat().st_size > 0
    for system in ("ubep", "bsp"):  # a trace per ubep system: both ranks, the shared Buffer's calls
        events = json.loads((tmp_path / f"trace-{system}.json").read_text())["traceEvents"]
        calls = [e for e in events if e["ph"] == "X" and e["name"] in ("dispatch", "combine")]
        assert {e["pid"] for e in calls} == {0, 1} and len({e["tid"] for e in calls}) == 1
        per_rank = [sum(e["pid"] == r and e["name"] == "dispatch" for e in calls) for r in (0, 1)]
        assert per_rank[0] == per_rank[1] > 0 and per_rank[0] % 2 == 0, per_rank  # 2 MoE layers a step
    assert not (tmp_path / "trace-all_to_all.json").exists()


def test_decode_config_refusals():
    with pytest.raises(ValueError, match="multiple of ranks"):
        DecodeConfig(ranks=3, experts=16).validate()
    with pytest.raises(ValueError, match="unknown"):
        DecodeConfig(systems=("ubep", "nccl")).validate()
