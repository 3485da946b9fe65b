"""`ubep bench`'s method without rank processes: the turn order, the paired bootstrap, the
report's JSON and table, the command line's refusals and a sweep interrupted by Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ubep
from ubep.bench import report
from ubep.bench import run as bench_run
from ubep.bench.ratio import paired_ratio
from ubep.bench.timing import Stats, latencies_us
from ubep.bench.turns import Calls, Conductor, Turns, round_order, take_turns
from ubep.bench.workload import BenchConfig
from ubep.cli import main

# --- turns -----------------------------------------------------------------------------------


def test_round_order_rotates_by_one_each_round():
    assert round_order(("a", "b", "c"), 4) == [
        ("a", "b", "c"),
        ("b", "c", "a"),
        ("c", "a", "b"),
        ("a", "b", "c"),
    ]
    order = round_order(("a", "b", "c", "d", "e"), 10)
    assert all(sorted(r) == ["a", "b", "c", "d", "e"] for r in order)  # each once a round
    for system in "abcde":  # and, over 5 rounds, once in each position
        assert sorted(r.index(system) for r in order[:5]) == [0, 1, 2, 3, 4]


def _thread_group(directory: str, ranks: int, systems: tuple[str, ...], log: list, lock: threading.Lock):
    """`ranks` threads taking turns as rank processes would, logging (system, rank, op) as they run."""
    results = [None] * ranks

    def rank_main(rank: int) -> None:
        def call(system: str, op: str):
            def run() -> None:
                with lock:
                    log.append((system, rank, op))

            return run

        calls = {s: Calls(call(s, "dispatch"), call(s, "combine")) for s in systems}
        turns = Turns(directory, rank, timeout_s=30)
        for system in systems if rank == 0 else ():
            turns.opened(system)
        results[rank] = take_turns(turns, calls, time.monotonic)
        turns.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    return threads, results


def test_conductor_runs_one_system_at_a_time_in_round_order(tmp_path):
    """Two groups of thread 'ranks': the log, cut into runs of one system, is the round order."""
    groups = {"launch": ("ubep", "bsp-shm", "memcpy-floor"), "mpi": ("mpi",)}
    group_of = {s: g for g, systems in groups.items() for s in systems}
    systems, rounds, ranks = ("ubep", "bsp-shm", "mpi", "memcpy-floor"), 5, 3
    conductor = Conductor(str(tmp_path), dict.fromkeys(groups, ranks), timeout_s=30)
    log, lock = [], threading.Lock()
    started = {g: _thread_group(conductor.directory(g), ranks, s, log, lock) for g, s in groups.items()}
    heard = []
    try:
        conductor.ready(dict.fromkeys(groups, lambda: None), heard.append)  # both groups at once
        assert sorted(heard) == sorted(systems)  # rank 0 of each named each of its systems
        for order in round_order(systems, rounds):
            for system in order:
                conductor.turn(group_of[system], system, lambda: None)
    finally:
        for g in groups:
            conductor.quit(g)
        for threads, _ in started.values():
            for t in threads:
                t.join(30)
        conductor.close()
    blocks = []  # consecutive log entries of one system
    for system, rank, op in log:
        if not blocks or blocks[-1][0] != system:
            blocks.append((system, []))
        blocks[-1][1].append((rank, op))
    expected = [s for order in round_order(systems, rounds) for s in order]
    assert [b[0] for b in blocks] == expected
    for _, entries in blocks:  # every rank ran both halves in its turn, dispatch before combine
        assert sorted(entries) == sorted((r, op) for r in range(ranks) for op in ("dispatch", "combine"))
        for r in range(ranks):
            assert [op for rank, op in entries if rank == r] == ["dispatch", "combine"]
    for g, (_, results) in started.items():  # one sample per round and rank, for each system and op
        for samples in results:
            assert set(samples) == set(groups[g])
            assert all(len(samples[s][op][0]) == rounds for s in groups[g] for op in ("dispatch", "combine"))


def test_conductor_reports_a_group_that_ended_instead_of_waiting(tmp_path):
    conductor = Conductor(str(tmp_path), {"launch": 2}, timeout_s=60)  # its wait for a group's turn

    def ended() -> None:
        raise RuntimeError("rank 1 failed: boom")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        conductor.turn("launch", "ubep", ended)
    assert time.monotonic() - start < 60  # told by the group, not at the deadline
    conductor.close()


def test_ready_hears_a_line_written_in_the_same_instant_as_the_last_answer(tmp_path, monkeypatch):
    """CI's race: rank 1 answers, the conductor's select wakes for it, and before its read rank 0
    says "mpi" and answers too; that read takes both answers, the wait ends, and the line was
    never heard (the bench then left mpi out of its "ready" lines)."""
    from ubep.bench import turns as turns_module

    conductor = Conductor(str(tmp_path), {"mpi": 2}, timeout_s=30)
    rank0, rank1 = (Turns(conductor.directory("mpi"), r, timeout_s=30) for r in (0, 1))
    real_select = turns_module.select.select
    raced = []

    def select_then_rank0_races_in(read, write, error, timeout):
        woke = real_select(read, write, error, timeout)
        if woke[0] and not raced:
            raced.append(True)
            rank0.opened("mpi")
            rank0.answer()
        return woke

    monkeypatch.setattr(turns_module.select, "select", select_then_rank0_races_in)
    rank1.answer()
    heard: list[str] = []
    conductor.ready({"mpi": lambda: None}, heard.append)
    assert raced and heard == ["mpi"]
    for turns in (rank0, rank1, conductor):
        turns.close()


def test_a_rank_without_a_turn_times_out(tmp_path):
    conductor = Conductor(str(tmp_path), {"launch": 1}, timeout_s=1)
    turns = Turns(conductor.directory("launch"), 0, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no turn"):
        turns.next()
    turns.close()
    conductor.close()


# --- the ratio and its interval ---------------------------------------------------------------


def _rounds(n: int, ratio: float, seed: int) -> tuple[list[float], list[float]]:
    """Synthetic rounds on a noisy host: a load factor shared by both systems in a round, times
    each system's own noise; median(a) / median(b) is `ratio` in the population."""
    rng = np.random.default_rng(seed)
    load = rng.lognormal(0.0, 0.5, n)
    a = ratio * 1000 * load * rng.lognormal(0.0, 0.2, n)
    b = 1000 * load * rng.lognormal(0.0, 0.2, n)
    return a.tolist(), b.tolist()


def test_interval_contains_the_point_ratio_and_narrows_with_more_rounds():
    widths = []
    for n in (20, 200, 2000):
        a, b = _rounds(n, 1.5, seed=n)
        got = paired_ratio(a, b)
        assert got.point == pytest.approx(statistics.median(a) / statistics.median(b), rel=1e-12)
        assert got.low <= got.point <= got.high
        widths.append(got.high - got.low)
    # Ten times the rounds: about 1/sqrt(10) = 0.32 of the width (at most 0.53 over 60 seeds).
    assert widths[1] < 0.6 * widths[0] and widths[2] < 0.6 * widths[1]


def test_interval_is_paired_over_rounds():
    """a = 2 b in every round: every resample of rounds gives exactly 2, however noisy b is.
    The same samples with the rounds shuffled apart give a wide interval."""
    b = _rounds(30, 1.0, seed=1)[1]
    a = [2 * v for v in b]
    assert paired_ratio(a, b) == (2.0, 2.0, 2.0)
    shuffled = paired_ratio(a, list(np.random.default_rng(2).permutation(b)))
    assert shuffled.high - shuffled.low > 0.3


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    trials = 200
    covered = 0
    for seed in range(trials):
        a, b = _rounds(30, 1.5, seed=1000 + seed)
        got = paired_ratio(a, b, resamples=500)
        covered += got.low <= 1.5 <= got.high
    assert 0.85 * trials <= covered <= 0.995 * trials


def test_paired_ratio_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="one sample per round"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="one sample per round"):
        paired_ratio([], [])


# --- rows, ratios and the table ---------------------------------------------------------------


def test_latencies_take_the_slowest_rank_from_the_common_start():
    starts = [10.0, 20.0, 30.0]
    finishes = [[10.001, 20.004, 30.002], [10.003, 20.001, 30.002]]  # rank 0, rank 1
    assert latencies_us(starts, finishes) == pytest.approx([3000, 4000, 2000])
    stats = Stats.of(latencies_us(starts, finishes))
    assert round(stats.median_us) == 3000 and round(stats.p99_us) == 4000


def _rows() -> list[report.Row]:
    d_ubep, c_ubep = [100.0, 120.0, 300.0, 110.0, 105.0], [50.0, 40.0, 90.0, 45.0, 60.0]
    d_bsp, c_bsp = [210.0, 250.0, 500.0, 230.0, 190.0], [90.0, 95.0, 200.0, 85.0, 100.0]
    d_floor, c_floor = [10.0, 11.0, 30.0, 9.0, 10.0], [8.0, 9.0, 20.0, 7.0, 8.0]
    return [
        report.Row.build("ubep", "normal", 8, 1e4, d_ubep, c_ubep),
        report.Row.build("bsp-gloo", "normal", 8, 1e4, d_bsp, c_bsp),
        report.Row.build("memcpy-floor", "normal", 8, 1e4, d_floor, c_floor),
    ]


def test_ratios_are_medians_of_per_round_totals():
    ubep_row, bsp, floor = report.with_ratios(_rows())
    ubep_totals = [150, 160, 390, 155, 165]  # by hand: dispatch + combine, round by round
    bsp_totals = [300, 345, 700, 315, 290]
    floor_totals = [18, 20, 50, 16, 18]
    assert bsp.vs_ubep == pytest.approx(315 / 160)
    assert bsp.vs_ubep_ci95[0] <= bsp.vs_ubep <= bsp.vs_ubep_ci95[1]
    assert ubep_row.vs_ubep == 1.0 and ubep_row.vs_ubep_ci95 == (1.0, 1.0)
    assert bsp.floor_fraction == pytest.approx(
        statistics.median(floor_totals) / statistics.median(bsp_totals)
    )
    assert floor.floor_fraction == 1.0
    assert statistics.median(ubep_totals) == 160
    assert bsp.dispatch_us == 230 and bsp.combine_p99_us == 200  # median, and p99 (the max of 5)


def test_table_fits_120_columns_and_is_never_cut(capsys):
    """Every column a run can have, and 10 s calls ("10,000,002"): the table splits in two (latency,
    then the ratios) rather than pass 120 columns (it was about 170) or cut a cell."""
    slow = [1e7 + i for i in range(5)]
    rows = report.with_ratios([*_rows(), report.Row.build("bsp-shm", "normal", 8, 1e4, slow, slow)])
    hier = dict(vs_hier_bsp=1.5, vs_hier_bsp_ci95=(1.25, 1.75))
    rows = [replace(r, boundary_bytes=123_456_789.0, **hier) for r in rows]
    report.print_table(rows, "normal mode, a title", ["a note"])
    out = capsys.readouterr().out
    assert "…" not in out and max(len(ln) for ln in out.splitlines()) <= 120
    for r in rows:
        lines = [ln for ln in out.splitlines() if ln.startswith(f"│ {r.system} ")]
        assert len(lines) == 2  # one in each half
        cells = [f"{r.dispatch_us:,.0f}", f"{r.combine_p99_us:,.0f}", f"{r.floor_fraction:.0%}"]
        cells += [f"{r.vs_ubep:.2f}" + ("" if r.system == "ubep" else f" ({r.vs_ubep_ci95[0]:.2f}-")]
        cells += ["1.50 (1.25-1.75)", f"{r.boundary_bytes / 1e6:.2f}"]
        for cell in cells:
            assert cell in " ".join(lines), (cell, lines)


def test_a_dash_says_why_and_a_column_of_dashes_is_left_out():
    """Across nodes there is no floor row: no "of floor" column of "-", a note instead; the floor
    row across nodes moves nothing between them: its "-" in "MB across nodes" gets a note."""
    ubep_row, gloo, floor = _rows()
    across = report.with_ratios([replace(ubep_row, boundary_bytes=1e6), replace(gloo, boundary_bytes=2e6)])
    shown, notes = report.tables(across, "t")
    headers = [c.header for t in shown for c in t.columns]
    assert "of floor" not in headers and "MB across nodes" in headers
    assert notes == ['no "of floor" column: ' + report.DASH["of floor"]]
    assert "one host only" in notes[0]
    rows = report.with_ratios([replace(ubep_row, boundary_bytes=1e6), floor])
    shown, notes = report.tables(rows, "t")
    assert notes == ['"-" in "MB across nodes": ' + report.DASH["MB across nodes"]]
    assert all(len(ln) <= 120 for t in shown for ln in _rendered(t).splitlines())


def _rendered(table) -> str:
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=1000)
    console.print(table)
    return console.file.getvalue()


def test_cpu_model_comes_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    assert report.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8480+"
    assert report.cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n") == (platform.processor() or "unknown")


def test_json_records_versions_host_and_date_and_replaces_the_whole_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text("x" * 100_000)  # a longer old file: nothing of it may survive
    before = datetime.now(UTC).replace(microsecond=0)
    meta = report.metadata()
    rows = report.with_ratios(_rows())
    report.write_json(str(path), config={"ranks": 2}, meta=meta, rows=rows, notes=["n"], complete=False)
    data = json.loads(path.read_text())
    assert os.listdir(tmp_path) == ["bench.json"]  # no temporary left beside it
    got = data["meta"]
    assert got["ubep"] == ubep.__version__ and got["torch"] == torch.__version__
    assert got["host"]["cores"] == os.cpu_count()
    assert got["host"]["platform"] == platform.platform()
    assert got["host"]["cpu"] == report.cpu_model()
    date = datetime.fromisoformat(got["date"])
    assert date.utcoffset().total_seconds() == 0
    assert before <= date <= datetime.now(UTC)
    assert data["complete"] is False and data["config"] == {"ranks": 2}
    bsp = data["results"][1]
    assert bsp["vs_ubep_ci95"] == list(rows[1].vs_ubep_ci95)
    assert bsp["dispatch_rounds_us"] == [210.0, 250.0, 500.0, 230.0, 190.0]


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", ["0", "-3", "8,0"])
def test_tokens_must_be_positive(tokens, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--tokens", tokens])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"ubep bench: error: argument --tokens: expected positive integers, got '{tokens}'"


def test_one_rank_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--ranks", "1"])
    assert "argument --ranks: must be at least 2, got 1" in capsys.readouterr().err


def test_ll_mode_with_mpi_only_is_one_clear_error():
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--mode", "ll", "--systems", "mpi"])
    message = str(exit_.value.code)
    assert message.startswith("ubep bench: no system left to run from --systems mpi: ll mode: no mpi row")
    assert "\n" not in message


def test_select_systems_drops_what_cannot_run_and_says_why():
    cfg = BenchConfig(mode="ll", systems=("ubep", "mpi", "memcpy-floor"))
    systems, notes = bench_run.select_systems(cfg, (True, ""))
    assert systems == ("ubep", "memcpy-floor") and "no mpi row" in notes[0]
    systems, notes = bench_run.select_systems(BenchConfig(systems=("mpi", "ubep")), (False, "no mpirun"))
    assert systems == ("ubep",) and notes == ["mpi row skipped: no mpirun"]
    with pytest.raises(ValueError, match="no mpirun"):
        bench_run.select_systems(BenchConfig(systems=("mpi",)), (False, "no mpirun"))
    with pytest.raises(ValueError, match="one host only"):
        bench_run.select_systems(BenchConfig(ranks=4, nodes=2, systems=("bsp-shm",)), (True, ""))


def test_the_low_latency_row_runs_beside_normal_mode_on_one_host_only():
    """ubep-ll times low-latency mode in a normal-mode run (its x ubep: the ratio of the two modes); in
    --mode ll the ubep row is that mode already, and across nodes low-latency mode has no row."""
    systems, notes = bench_run.select_systems(BenchConfig(systems=("ubep", "ubep-ll")), (True, ""))
    assert systems == ("ubep", "ubep-ll") and "over normal mode" in notes[-1]
    systems, notes = bench_run.select_systems(BenchConfig(mode="ll", systems=("ubep", "ubep-ll")), (True, ""))
    assert systems == ("ubep",) and "no ubep-ll row" in notes[-1]
    systems, notes = bench_run.select_systems(
        BenchConfig(ranks=4, nodes=2, systems=("ubep", "ubep-ll")), (True, "")
    )
    assert systems == ("ubep",) and "no ubep-ll row (one host only)" in notes[0]


def test_rows_across_nodes_run_only_across_nodes_and_nixl_only_where_installed(monkeypatch):
    across = ("ubep", "ubep-gloo", "ubep-nixl", "hier-bsp", "bsp-gloo")
    systems, notes = bench_run.select_systems(BenchConfig(systems=across), (True, ""))
    assert systems == ("ubep", "bsp-gloo") and "no ubep-gloo, ubep-nixl, hier-bsp row" in notes[0]
    monkeypatch.setattr(bench_run, "nixl_available", lambda: (False, "NIXL is not installed"))
    systems, notes = bench_run.select_systems(BenchConfig(nodes=2, systems=across), (True, ""))
    assert (
        systems == ("ubep", "ubep-gloo", "hier-bsp", "bsp-gloo")
        and notes[0] == "ubep-nixl row skipped: NIXL is not installed"
    )


def test_the_ratio_to_hier_bsp_has_its_interval():
    rows = [*_rows(), replace(_rows()[1], system="hier-bsp")]
    got = report.with_ratios(rows)
    ubep_row, bsp, _, hier = got
    assert ubep_row.vs_hier_bsp == pytest.approx(160 / 315) and hier.vs_hier_bsp == 1.0
    assert ubep_row.vs_hier_bsp_ci95[0] <= ubep_row.vs_hier_bsp <= ubep_row.vs_hier_bsp_ci95[1]
    assert bsp.vs_hier_bsp == 1.0  # the same rounds
    shown, _ = report.tables(got, "t")
    assert "x hier-bsp (95% CI)" in [c.header for t in shown for c in t.columns]


def test_hosts_fall_back_to_emulated_nodes_and_say_why(monkeypatch, capsys):
    from ubep.bench import hosts

    planned = []

    def plan(cfg):
        planned.append(cfg)
        raise ValueError("stop here")

    no_root = hosts.Namespaces(False, "network namespaces need root")
    monkeypatch.setattr(hosts, "namespaces_available", lambda: no_root)
    monkeypatch.setattr(bench_run, "plan", plan)
    with pytest.raises(SystemExit):
        main(["bench", "--hosts", "2"])
    assert (
        "no namespace hosts (network namespaces need root): 2 emulated nodes instead"
        in capsys.readouterr().out
    )
    (cfg,) = planned
    assert (
        cfg.nodes == 2
        and not cfg.namespaces
        and cfg.systems == ("ubep", "ubep-gloo", "ubep-nixl", "hier-bsp", "bsp-gloo")
    )


def test_hosts_that_do_not_split_the_ranks_name_the_hosts_flag():
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--hosts", "3"])
    assert exit_.value.code == "ubep bench: --ranks (8) must split evenly into --hosts (3)"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--nodes", "3"])
    assert exit_.value.code == "ubep bench: --ranks (8) must split evenly into --nodes (3)"


@pytest.mark.parametrize(
    "netem,said",
    [
        (False, "links between the 2 hosts: 1gbit by a token bucket (tc tbf, burst 250000 bytes); no delay: "
         "kernel has no netem"),
        (True, "links between the 2 hosts: 1gbit, 15us one way (tc netem)"),
    ],
)  # fmt: skip
def test_hosts_say_what_the_links_are_under_the_table(netem, said, tmp_path, monkeypatch, capsys):
    from ubep.bench import hosts

    def measure(cfg, tokens, systems, progress):
        return report.with_ratios([report.Row.build("ubep", cfg.mode, tokens, 1e4, [100.0], [50.0])])

    monkeypatch.setattr(hosts, "namespaces_available", lambda: hosts.Namespaces(True, "as if", netem))
    monkeypatch.setattr(bench_run, "plan", lambda cfg: (("ubep",), []))
    monkeypatch.setattr(bench_run, "measure", measure)
    argv = [
        "bench",
        "--hosts",
        "2",
        "--ranks",
        "2",
        "--experts",
        "8",
        "--tokens",
        "8",
        "--link-rate",
        "1gbit",
    ]
    assert main([*argv, "--json", str(tmp_path / "run.json")]) == 0
    assert said in " ".join(capsys.readouterr().out.split())
    link = json.loads((tmp_path / "run.json").read_text())["meta"]["link"]
    assert link == {
        "rate": "1gbit",
        "bytes_per_s": 125_000_000,
        "burst_bytes": None if netem else 250_000,
        "delay": "15us" if netem else None,
        "racks": 1,
        "rack_rate": None,
        "rack_bytes_per_s": None,
        "rack_burst_bytes": None,
    }  # one rack: no uplink
    told = hosts.hosts_command(BenchConfig(nodes=2, link_rate="1gbit"), ["measure"])
    assert told[told.index("-r") + 1] == "1gbit" and "-b" not in told  # the script sizes the burst itself


def test_an_interrupted_sweep_keeps_its_rows_and_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second batch size: the first one's rows are in the JSON (written as
    soon as they were measured) and on the screen, and the exit status is 130."""
    path = tmp_path / "sweep.json"
    seen_on_disk = []

    def measure(cfg, tokens, systems, progress):
        if tokens == 16:
            seen_on_disk.append(json.loads(path.read_text()))
            raise KeyboardInterrupt
        return report.with_ratios(
            [
                report.Row.build("ubep", cfg.mode, tokens, 1e4, [100.0, 110.0, 90.0], [50.0, 55.0, 45.0]),
                report.Row.build(
                    "bsp-gloo", cfg.mode, tokens, 1e4, [300.0, 310.0, 290.0], [90.0, 95.0, 85.0]
                ),
            ]
        )

    monkeypatch.setattr(bench_run, "plan", lambda cfg: (("ubep", "bsp-gloo"), ["engine: test"]))
    monkeypatch.setattr(bench_run, "measure", measure)
    code = main(["bench", "--ranks", "2", "--experts", "8", "--tokens", "8,16,32", "--json", str(path)])
    assert code == 130
    (on_disk,) = seen_on_disk
    assert [r["tokens_per_rank"] for r in on_disk["results"]] == [8, 8]
    assert on_disk["complete"] is False
    final = json.loads(path.read_text())
    assert [r["system"] for r in final["results"]] == ["ubep", "bsp-gloo"]
    assert final["complete"] is False and final["notes"][-1] == "interrupted: 1 of 3 batch sizes measured"
    out = capsys.readouterr().out
    assert "bsp-gloo" in out and "interrupted: 1 of 3 batch sizes measured" in out


def test_a_finished_sweep_says_complete(tmp_path, monkeypatch):
    path = tmp_path / "sweep.json"

    def measure(cfg, tokens, systems, progress):
        return [report.Row.build("ubep", cfg.mode, tokens, 1e4, [100.0], [50.0])]

    monkeypatch.setattr(bench_run, "plan", lambda cfg: (("ubep",), []))
    monkeypatch.setattr(bench_run, "measure", measure)
    assert main(["bench", "--ranks", "2", "--experts", "8", "--tokens", "8,16", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["complete"] is True and [r["tokens_per_rank"] for r in data["results"]] == [8, 16]


def _peak_rss() -> int:
    """This process's peak resident set since the last `_reset_peak_rss()` (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the peak resident set restarts from the current one


def test_low_latency_check_takes_one_ranks_rows_not_every_ranks():
    """The bench's low-latency check held every rank's [L, R * T, H] rows on every rank: 3.8 GB a rank
    at its default shape, 30 GB over 8 ranks, which ran the host out of memory. At 8 ranks here, every
    rank's rows are 8 x 16 MiB; the check's peak must stay near one rank's."""
    from ubep import reference
    from ubep.bench.torch_systems import verify_ll
    from ubep.bench.workload import build

    cfg, me, T = BenchConfig(ranks=8, tokens=(64,), hidden=4096, experts=32, topk=8), 3, 64
    work = build(cfg, T)
    mine = reference.low_latency_dispatch(work.xs, work.topk_idx, cfg.experts, T)[me]  # the others freed
    got = SimpleNamespace(recv_count=mine.recv_count_L, recv_x=mine.recv_x_LMX)
    x, idx = work.xs[me], work.topk_idx[me]
    combined = reference.weighted_sum(x[:, None].expand(T, 8, 4096), work.topk_weights[me], idx >= 0)
    _reset_peak_rss()
    before = _peak_rss()
    verify_ll("ubep", got, combined.to(x.dtype), work, T, me)
    grown = _peak_rss() - before
    assert grown < 4 * mine.recv_x_LMX.nbytes, (grown, mine.recv_x_LMX.nbytes)


def test_a_rank_refused_shared_memory_is_told_in_the_command_lines_terms():
    """The ranks' SharedMemorySizeError names Python arguments (max_tokens_per_rank, low_latency); the
    bench says it with its own flags, and leaves any other failure alone."""
    from ubep.bench.run import room_refused
    from ubep.errors import SharedMemorySizeError
    from ubep.launcher import RankFailedError
    from ubep.transport.segments import Creator, Introduction, check_room

    room = Introduction(Creator.this_process(), "t", 2**30, None, None)
    with pytest.raises(SharedMemorySizeError) as caught:
        check_room(2**30, [room] * 8, 2**29)
    traceback = (
        f"Traceback (most recent call last):\n  ...\nubep.errors.SharedMemorySizeError: {caught.value}\n"
    )
    said = room_refused(RankFailedError(3, f"rank 3 failed:\n{traceback}"))
    assert said.startswith("Buffer construction: the shared segments need 4294967296 bytes"), said
    assert "--tokens" in said and "--systems" in said
    assert "max_tokens_per_rank" not in said and "low_latency" not in said
    assert room_refused(RankFailedError(1, "rank 1 failed:\nValueError: x has 9 tokens")) is None


# --- results files: the command of a run, the table of the newest runs ---------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        BenchConfig(),
        BenchConfig(tokens=(8, 128), timeout_s=60.0, seed=3),
        BenchConfig(
            nodes=2, namespaces=True, systems=("ubep", "ubep-gloo", "ubep-nixl", "hier-bsp", "bsp-gloo")
        ),
        BenchConfig(ranks=4, nodes=2, namespaces=True, link_rate="1gbit", systems=("ubep", "hier-bsp")),
        BenchConfig(ranks=4, nodes=2, systems=("ubep", "bsp-gloo"), slow_rank=1, delay_us=2500.0),
        BenchConfig(routing="zipf", skew=1.2, workers=2, schedule="balanced", mode="ll", dtype="fp32"),
        BenchConfig(systems=("ubep",), stats_path="s.json", iters=60, placements=("eplb",), redundant=4),
        BenchConfig(
            nodes=4,
            namespaces=True,
            link_rate="1gbit",
            racks=2,
            rack_link_rate="100mbit",
            systems=("ubep-tiers", "ubep", "ubep-dist", "hier-bsp"),
        ),
        BenchConfig(nodes=4, racks=2, rack_link_rate="100mbit", systems=("ubep-tiers", "ubep")),
    ],
)
def test_the_command_of_a_run_measures_that_run(cfg):
    """What `results.command` writes, read back by the bench's own parser, is the same run."""
    from ubep.bench.results import command
    from ubep.cli import build_parser

    said = command(cfg).split()
    args = build_parser().parse_args(said[1:])
    assert said[:2] == ["ubep", "bench"] and args.command == "bench"
    assert (args.hosts or args.nodes, bool(args.hosts)) == (cfg.nodes, cfg.namespaces)
    default_systems = (
        ("ubep-tiers", "ubep", "ubep-dist", "hier-bsp")
        if cfg.racks > 1
        else ("ubep", "ubep-gloo", "ubep-nixl", "hier-bsp", "bsp-gloo")
        if cfg.nodes > 1
        else BenchConfig().systems
    )
    assert (args.systems or default_systems) == cfg.systems and bool(args.stats) == bool(cfg.stats_path)
    same = ("ranks", "tokens", "hidden", "experts", "topk", "iters", "warmup", "routing", "skew", "mode")
    same += ("dtype", "seed", "workers", "schedule", "slow_rank", "delay_us", "redundant")
    assert {f: getattr(args, f) for f in same} == {f: getattr(cfg, f) for f in same}
    assert (args.timeout, args.placement, args.link_rate) == (cfg.timeout_s, cfg.placements, cfg.link_rate)
    assert (args.racks, args.rack_link_rate) == (cfg.racks, cfg.rack_link_rate)


def _results_file(date: str, cpu: str, vs_bsp: float, ubep_rounds: list[float], **config) -> dict:
    """A results file as `ubep bench --json` writes it, at one batch size of 8 tokens."""
    rows = [
        report.Row.build("ubep", "normal", 8, 1e4, *([r / 2 for r in ubep_rounds],) * 2),  # d + c: a round
        replace(report.Row.build("bsp-shm", "normal", 8, 1e4, [1.0], [1.0]), vs_ubep=vs_bsp),
    ]
    return {
        "config": BenchConfig(**config).as_dict(),
        "meta": {"date": date, "host": {"cpu": cpu, "cores": 2}},
        "complete": True,
        "results": [json.loads(json.dumps(dataclasses.asdict(r))) for r in rows],
    }


def test_the_table_takes_each_commands_newest_day_on_one_host_and_medians_over_its_runs():
    from ubep.bench import results

    files = [
        _results_file("2026-12-01T10:00:00+00:00", "A", 9.0, [900.0], tokens=(8,)),  # an older day
        _results_file("2026-12-02T10:00:00+00:00", "A", 1.0, [100.0, 300.0, 200.0], tokens=(8,)),
        _results_file("2026-12-02T11:00:00+00:00", "A", 4.0, [400.0], tokens=(8,)),
        _results_file("2026-12-02T12:00:00+00:00", "A", 2.0, [250.0, 260.0], tokens=(8,)),
        _results_file("2026-12-02T09:00:00+00:00", "B", 7.0, [700.0], tokens=(8,)),  # another host
        _results_file("2026-12-01T09:00:00+00:00", "A", 3.0, [50.0], ranks=2, tokens=(8,)),
        {
            **_results_file("2026-12-03T09:00:00+00:00", "A", 5.0, [1.0], ranks=2, tokens=(8,)),
            "complete": False,
        },
        {"config": {}, "results": []},  # not dated: before the bench recorded when
    ]
    groups = results.newest_runs(files)
    assert [(g.command, len(g.files), g.date) for g in groups] == [
        ("ubep bench --tokens 8", 3, "2026-12-02"),
        ("ubep bench --ranks 2 --tokens 8", 1, "2026-12-01"),  # the plainest command first
    ]
    table = results.markdown(groups).splitlines()
    assert table[0] == "| command | date (UTC) | host | runs | tokens/rank | ubep d+c (us) | bsp-shm |"
    # ubep: the median of each run's median over rounds (200, 400, 255); bsp-shm: of 1.0, 4.0, 2.0
    assert table[2] == "| `ubep bench --tokens 8` | 2026-12-02 | A, 2 cores | 3 | 8 | 255 | 2.00 |"
    assert table[3] == "| `ubep bench --ranks 2 --tokens 8` | 2026-12-01 | A, 2 cores | 1 | 8 | 50 | 3.00 |"
    assert not results.is_bench_results({"ranks": [0, 1], "calls": {}})  # a stats file


def test_report_prints_a_bench_results_file_again(tmp_path, capsys):
    """`ubep report` on a bench file said "missing field 'ranks'"; it shows the table, when, where
    and the command, and refuses the stats exports in one line."""
    path = tmp_path / "bench.json"
    rows = report.with_ratios(_rows())
    cfg = BenchConfig(ranks=2, tokens=(8,), experts=8)
    report.write_json(
        str(path), config=cfg.as_dict(), meta=report.metadata(), rows=rows, notes=["n"], complete=True
    )
    assert main(["report", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for r in rows:
        assert f"│ {r.system} │ 8 │ {r.dispatch_us:,.0f} │" in out
    assert (
        f"on {report.cpu_model()}, {os.cpu_count()} cores: ubep bench --ranks 2 --tokens 8 --experts 8" in out
    )
    with pytest.raises(SystemExit) as ended:
        main(["report", str(path), "--trace", str(tmp_path / "t.json")])
    assert str(ended.value.code).startswith(
        f"ubep report: {path} is a bench results file (ubep bench --json)"
    )


@pytest.mark.parametrize(
    "rate,bits_per_s", [("1gbit", 10**9), ("25gbit", 25 * 10**9), ("2500mbit", 25 * 10**8), ("8kbit", 8000)]
)
def test_the_links_burst_holds_the_rate_per_call(rate, bits_per_s):
    """The script's token bucket (asked with -s: nothing made, no root) holds 2 ms at the rate, and
    at least one 1514-byte frame: at 1gbit a 2 MB call can burst out at most an eighth of itself,
    where the 4 MB burst of before let all of it through at line speed (issue 44)."""
    from ubep.bench import hosts

    link = hosts.link_of(rate, netem=False)
    assert link.bytes_per_s == bits_per_s // 8
    assert link.burst_bytes == max(bits_per_s // 8 * 2 // 1000, 1514)
    assert link.delay is None and "no delay: kernel has no netem" in link.note(2)
    if rate == "1gbit":
        assert link.burst_bytes * 8 <= 2_000_000
    netem = hosts.link_of(rate, netem=True)
    assert netem.burst_bytes is None and netem.delay == hosts.LINK_DELAY


def test_a_rate_or_burst_the_script_cannot_size_is_refused_naming_it(monkeypatch):
    from ubep.bench import hosts

    with pytest.raises(ValueError) as refused:
        hosts.link_of("1.5gbit", netem=False)
    assert (
        str(refused.value)
        == "netns_hosts: -r must be a whole number of bit, kbit, mbit, gbit or tbit, got 1.5gbit"
    )
    monkeypatch.setattr(hosts, "namespaces_available", lambda: hosts.Namespaces(True, "as if"))
    with pytest.raises(SystemExit) as ended:
        main(["bench", "--hosts", "2", "--link-rate", "fast"])
    assert str(ended.value).startswith(
        "ubep bench --link-rate: netns_hosts: -r must be"
    ) and "got fast" in str(ended.value)
    small = subprocess.run(["bash", str(hosts.SCRIPT), "-b", "1000", "-s"], capture_output=True, text=True)
    assert small.returncode == 2 and "at least one 1514-byte frame, got 1000" in small.stderr
