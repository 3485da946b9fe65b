"""`ubep bench` end to end at a tiny shape, on 2 ranks: every system verified and timed in
turns, JSON and plot written. The method's logic is tested without processes in test_bench_method.py."""

from __future__ import annotations

import json

from ubep.bench import mpi_system
from ubep.bench.run import nixl_available
from ubep.cli import main


def test_bench_small_sweep_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [
            "bench",
            "--ranks",
            "2",
            "--tokens",
            "4,16",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--routing",
            "zipf",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    systems = {r["system"] for r in data["results"]}
    expected = {"ubep", "bsp-shm", "bsp-gloo", "memcpy-floor"} | (
        {"mpi"} if mpi_system.available()[0] else set()
    )
    assert systems == expected
    assert sorted({r["tokens_per_rank"] for r in data["results"]}) == [4, 16]
    for row in data["results"]:
        assert row["dispatch_us"] > 0 and row["combine_p99_us"] >= row["combine_us"]
        assert len(row["dispatch_rounds_us"]) == len(row["combine_rounds_us"]) == 3  # --iters rounds
        low, high = row["vs_ubep_ci95"]
        assert low <= row["vs_ubep"] <= high
        if row["system"] == "ubep":
            assert row["vs_ubep"] == 1.0
    assert data["config"]["ranks"] == 2 and png.stat().st_size > 0
    assert data["complete"] is True and data["meta"]["host"]["cores"] > 0
    said = capsys.readouterr().err.splitlines()  # each row said ready, from its ranks, before round 1
    for tokens in (4, 16):
        mine = [line for line in said if line.startswith(f"ubep bench: {tokens} tokens/rank: ")]
        ready = [line.split(": ")[2].split()[0] for line in mine if " ready (open, and checked" in line]
        assert sorted(ready) == sorted(expected) and "every row ready" in mine[1 + len(ready)], mine


def test_bench_low_latency_mode(tmp_path):
    out = tmp_path / "ll.json"
    code = main(
        [
            "bench",
            "--mode",
            "ll",
            "--ranks",
            "2",
            "--tokens",
            "8",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["system"] for r in rows} == {"ubep", "bsp-gloo", "memcpy-floor"}
    assert all(r["mode"] == "ll" for r in rows)


def test_bench_low_latency_row_beside_normal_mode(tmp_path):
    """The ubep-ll row: low-latency mode in the rounds of a normal-mode run, checked against the
    reference like every row, its bytes low-latency mode's (a row per (token, expert) pair)."""
    out = tmp_path / "both.json"
    shape = ["--ranks", "2", "--tokens", "8", "--hidden", "256", "--experts", "8", "--topk", "2"]
    code = main(
        ["bench", *shape, "--iters", "2", "--warmup", "1", "--systems", "ubep,ubep-ll", "--json", str(out)]
    )
    assert code == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ubep", "ubep-ll"} and rows["ubep-ll"]["vs_ubep"] > 0
    # 2 ranks, top-2 of 8 experts: 8 tokens x 2 pairs per rank land as 16 rows on average in ll mode,
    # fewer (a token whose two experts share a rank lands once) in normal mode
    assert rows["ubep-ll"]["bytes_per_rank"] == 16 * 256 * 2 > rows["ubep"]["bytes_per_rank"]


def test_bench_emulated_nodes_report_bytes_across(tmp_path):
    out = tmp_path / "nodes.json"
    code = main(
        [
            "bench",
            "--ranks",
            "4",
            "--nodes",
            "2",
            "--tokens",
            "8",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--topk",
            "4",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    nixl = {"ubep-nixl"} if nixl_available()[0] else set()
    assert set(rows) == {"ubep", "ubep-gloo", "hier-bsp", "bsp-gloo"} | nixl  # the default rows across nodes
    # The hierarchical transport sends a token once per remote node: never more bytes than flat.
    assert 0 < rows["ubep"]["boundary_bytes"] <= rows["bsp-gloo"]["boundary_bytes"]
    assert rows["hier-bsp"]["boundary_bytes"] == rows["ubep"]["boundary_bytes"]
    assert rows["ubep"]["vs_hier_bsp"] is not None and rows["hier-bsp"]["vs_hier_bsp"] == 1.0


def test_bench_one_rank_per_node_runs_what_auto_picks(tmp_path, capsys):
    """One rank per node: the ubep row runs transport dist, as a Buffer's "auto" does there, not hier,
    whose crossing saves nothing then and sends float32 partials back: fewer bytes than hier-bsp's."""
    out = tmp_path / "one_each.json"
    shape = ["--tokens", "8", "--hidden", "256", "--experts", "8", "--topk", "4", "--iters", "2"]
    argv = ["bench", "--ranks", "2", "--nodes", "2", "--systems", "ubep,hier-bsp", *shape, "--warmup", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "ubep runs the transport auto picks, dist" in " ".join(capsys.readouterr().out.split())
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    # 2 ranks, 4 of 8 experts each: a token crosses at most once either way; hier's partials are
    # float32 where dist returns bf16 rows, so its combine sends twice the bytes of x back.
    assert 0 < rows["ubep"]["boundary_bytes"] < rows["hier-bsp"]["boundary_bytes"]


def test_bench_profile_of_low_latency_mode(capsys):
    """--profile --mode ll: the call timers and the CPU categories of low-latency calls (not of
    normal-mode ones, which the profile timed alone before)."""
    shape = ["--ranks", "2", "--tokens", "4", "--hidden", "256", "--experts", "8", "--topk", "2"]
    assert main(["bench", "--mode", "ll", "--profile", *shape, "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "ll_dispatch" in out and "ll_combine" in out and "ll-mode combine: CPU time per call" in out
    assert "normal-mode" not in out
