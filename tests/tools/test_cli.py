"""The `ubep` command line as a new user meets it: without the optional extras, and with bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import version
from typing import NamedTuple

import pytest
from repo import ROOT

from ubep.bench.workload import BenchConfig
from ubep.cli import main
from ubep.extras import install_hint

SRC = os.path.join(ROOT, "src")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))

WITHOUT_NUMBA = """
import contextlib, io, json, sys
sys.modules["numba"] = None  # `import numba` now raises ModuleNotFoundError, as without the `fast` extra
from ubep.cli import main
for argv in ([], ["bench"], ["simulate"], ["plan"], ["decode"], ["warm"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([*argv, "--help"])
        except SystemExit as done:
            assert done.code == 0, (argv, done.code)
    assert out.getvalue().startswith("usage: ubep"), argv
with contextlib.redirect_stdout(io.StringIO()):
    main(["simulate", "--ranks", "8", "--tokens", "8", "--json", sys.argv[1]])
from ubep.sim import fairshare
print("compiled" if fairshare.COMPILED else "python")
"""


def test_every_command_works_without_numba(tmp_path):
    """`--help` of every command, and a simulation, with numba hidden: the simulator's event loop
    runs as Python and gives the same figures as where numba is installed."""
    without = tmp_path / "without.json"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_NUMBA), str(without)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["python"]
    here = tmp_path / "here.json"
    assert main(["simulate", "--ranks", "8", "--tokens", "8", "--json", str(here)]) == 0
    assert json.loads(without.read_text())["results"] == json.loads(here.read_text())["results"]


def test_warm_fills_the_cache_and_says_where(capsys):
    """`ubep warm` (scripts/setup.sh runs it): every warm-up, then one line naming the cache."""
    pytest.importorskip("numba")
    assert main(["warm"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"ubep warm: \d+ kernels (loaded from the cache|compiled .*|: .*), cached in .*", line
    ), line


def test_warm_counts_the_same_kernels_compiled_or_loaded():
    """Setup said "kernels 101 compiled", a rerun "32 loaded from the cache": the first counted the
    functions compiled inside others too, which come from the cache inside their callers. A kernel
    is now a signature called from Python, whichever way it came."""
    numba = pytest.importorskip("numba")
    from ubep.cli import warm_counts
    from ubep.engine.compile_once import counting_compiles

    @numba.njit(cache=False)
    def inner(v):
        return v + 1

    @numba.njit(cache=False)
    def outer(v):
        return inner(v) * 2

    with counting_compiles() as first:
        assert outer(1) == 4 and outer(2.5) == 7.0  # two signatures of outer, each compiling inner's
    with counting_compiles() as again:
        outer(3)
    assert (first.entry, first.inner) == (2, 2) and (again.entry, again.inner) == (0, 0)
    assert warm_counts(32, 69, 0) == "32 kernels compiled (and 69 functions inside them)"
    assert warm_counts(0, 0, 32) == "32 kernels loaded from the cache"
    assert (
        warm_counts(4, 2, 28)
        == "32 kernels: 4 compiled (and 2 functions inside them), 28 loaded from the cache"
    )


def test_version_names_the_installed_package(capsys):
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    else:
        raise AssertionError("--version did not exit")
    assert capsys.readouterr().out.split() == ["ubep", version("ubep")]


SMALL_FABRIC = {  # two nodes of four devices; a slow port between them
    "name": "small",
    "ports_gbps": {"nvlink": 100, "net": 5},
    "levels": [
        {"name": "device", "span": 1, "latency_us": 0.2, "port": "nvlink"},
        {"name": "node", "span": 4, "latency_us": 1.0, "port": "nvlink"},
        {"name": "cluster", "span": 8, "latency_us": 3.0, "port": "net"},
    ],
}


@pytest.mark.parametrize(
    "argv,said",
    [
        (["simulate", "--topology", "nosuch"], "ubep simulate: topology must be one of host, cm384"),
        (["simulate", "--ranks", "7"], "ubep simulate: --ranks 7 must divide the 256 experts of deepseek-v3"),
        (["simulate", "--topology", "{bad}"], "ubep simulate: topology file {bad}: Expecting property name"),
        (["plan", "--topology", "{bad}"], "ubep plan: topology file {bad}: Expecting property name"),
        (["plan", "--topology", "{partial}"], "ubep plan: topology file {partial}: missing 'levels'"),
        (
            ["plan", "--topology", "nope.json"],
            "ubep plan: topology file nope.json does not exist (a topology",
        ),
        (["simulate", "--topology", "{gone}"], "ubep simulate: topology file {gone} does not exist"),
        (["plan", "--topology", "{folder}"], "ubep plan: topology file {folder} is not a file"),
    ],
)
def test_bad_simulator_arguments_give_one_line_naming_the_problem(tmp_path, argv, said):
    files = {"bad": tmp_path / "bad.json", "partial": tmp_path / "partial.json", "folder": tmp_path}
    files["gone"] = tmp_path / "gone" / "fabric"  # no .json: a path all the same
    files["bad"].write_text('{"name": "x",\n')
    files["partial"].write_text('{"name": "x", "ports_gbps": {"p": 1}}')
    argv = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as done:
        main(argv)
    message = str(done.value.code)
    assert message.startswith(said.format(**files)) and "\n" not in message


def test_plan_says_what_it_simulates_as_it_goes(tmp_path, capsys):
    fabric = tmp_path / "small.json"
    fabric.write_text(json.dumps(SMALL_FABRIC))
    assert main(["plan", "--topology", str(fabric), "--model", "qwen3-30b", "--tokens", "8"]) == 0
    out, err = capsys.readouterr()
    steps = err.splitlines()
    assert steps[0].startswith("ubep plan: simulating protocol ubep (")
    assert any(s.startswith("ubep plan: simulating workers per rank: ") for s in steps)
    assert steps[-1].startswith("ubep plan: simulating prediction at 8 tokens per rank (")
    assert "small, qwen3-30b: protocol" in out  # the advice itself stays on stdout


def test_decode_prints_its_table_and_its_progress_and_nothing_else():
    """No transformers loading bars (one per model load, in every rank) and no leaked-semaphore
    warning at exit (tqdm's lock in the rank processes); a progress line per system and run on stderr."""
    pytest.importorskip("transformers")  # the `frameworks` extra
    tiny = ["--steps", "1", "--warmup", "1", "--repeats", "1", "--systems", "ubep,all_to_all"]
    env = {k: v for k, v in ENV.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run(
        [sys.executable, "-m", "ubep", "decode", *tiny], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    progress = done.stderr.splitlines()  # a line per system and run, nothing else
    assert [line.split(",")[0] for line in progress] == ["ubep decode: ubep", "ubep decode: all_to_all"]
    assert all(re.search(r"run 1 of 1: [\d.]+ ms/token on rank 0 \(\d+ s\)$", line) for line in progress)
    assert done.stdout.splitlines()[1].split()[:2] == ["system", "ms/token"]


@pytest.fixture
def without_rich(monkeypatch):
    """As after a plain install, without the `bench` extra: importing rich (or any part) raises."""
    for name in [n for n in sys.modules if n == "rich" or n.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)


def test_simulate_runs_without_rich_and_labels_its_ratio_as_dispatch(without_rich, capsys):
    assert main(["simulate", "--ranks", "8", "--tokens", "8"]) == 0
    header, rule, *rows = capsys.readouterr().out.splitlines()[1:]
    assert header.split("  ")[-1] == "dispatch vs bsp"  # the ratio compares dispatch times only
    assert set(rule) == {"-", " "} and [r.split()[1] for r in rows] == ["ubep", "bsp"]


def test_plan_runs_without_rich_and_says_what_its_totals_are(without_rich, tmp_path, capsys):
    fabric = tmp_path / "small.json"
    fabric.write_text(json.dumps(SMALL_FABRIC))
    assert main(["plan", "--topology", str(fabric), "--model", "qwen3-30b", "--tokens", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "dispatch + combine at 16 tokens per rank" in out  # the largest batch, where it chose
    start = out.index("workers per rank:")
    workers = out[start : out.index("\n", out.index("predicted") - 2)].replace("workers per rank:", "")
    lines = workers.strip().splitlines()
    entries = [e for line in lines for e in line.strip().rstrip(",").split(", ")]
    assert all(re.fullmatch(r"\d+\.\d us at \d+", e) for e in entries), lines  # no entry cut by a line break
    assert [int(e.split()[-1]) for e in entries] == sorted(int(e.split()[-1]) for e in entries)


def test_bench_without_rich_names_the_extra_and_how_to_install_it(without_rich):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--tokens", "8"])
    assert (
        done.value.code == "ubep bench needs rich (the 'bench' extra: pip install '.[bench]' in ubep's clone)"
    )


def test_every_install_hint_names_the_clone_not_a_package_index():
    """ubep is on no package index: no text tells anyone to `pip install ubep`, and every hint in the
    code for an extra is worded as `ubep.extras.install_hint` words it."""
    texts = {}
    for folder in ("src", "docs"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            texts |= {os.path.join(base, f): "" for f in files if f.endswith((".py", ".md"))}
    for path in [*texts, os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]:
        with open(path) as f:
            texts[path] = f.read()
    for path, text in texts.items():
        assert not re.search(r"pip install ['\"]?ubep\b", text), path
        assert "'ubep[" not in text and '"ubep[' not in text, path
    for path, text in texts.items():  # the code's literal hints, and extras.py's one wording of them
        if path.endswith(".py") and not path.endswith(os.path.join("ubep", "extras.py")):
            for extra in re.findall(r"pip install '\.\[(\w+)\]'", text):
                assert install_hint(extra) in text, (path, extra)


class FakeRow(NamedTuple):
    system: str
    dispatch_us: float
    combine_us: float


def test_bench_says_a_line_per_stage_and_system_when_no_bar_can_be_drawn(monkeypatch, capsys):
    """Per batch size: what it starts, each row as it is ready (MPI's start-up is the slow one: it
    was 26-63 s of silence after "starting 8 ranks"), the first round, and a line per result."""
    from ubep.bench import run

    def measure(cfg, tokens, systems, progress):
        for system in reversed(systems):
            progress.opened(system)
        for _ in range(cfg.warmup + cfg.iters):
            progress.advance()
        return [FakeRow(s, 10.0 * tokens, 20.0) for s in systems]

    monkeypatch.setattr(run, "measure", measure)
    got = []
    cfg = BenchConfig(ranks=2, tokens=(8, 16), iters=3, warmup=1)
    run.run(cfg, ("ubep", "bsp-shm", "mpi"), got.append)  # stderr is captured: not a terminal
    lines = capsys.readouterr().err.splitlines()
    assert len(got) == 2 and len(lines) == 2 * (1 + 3 + 1 + 3)  # per size: start, ready, round, results
    assert all(re.fullmatch(r"ubep bench: (8|16) tokens/rank: .* \(\d+ s\)", line) for line in lines), lines
    assert (
        "starting 2 ranks for ubep, bsp-shm and an mpirun job of 2 for mpi; each row is checked" in lines[0]
    )
    assert [line.split(": ")[2] for line in lines[1:4]] == [
        "mpi ready (open, and checked against the reference) (0 s)",
        "bsp-shm ready (open, and checked against the reference) (0 s)",
        "ubep ready (open, and checked against the reference) (0 s)",
    ]
    assert "every row ready; round 1 of 4 done (1 warm-up)" in lines[4]
    assert "ubep: dispatch 160.0 us, combine 20.0 us" in lines[-3] and "mpi" in lines[-1]


RANK_TRACEBACK = """rank 3 failed:
Traceback (most recent call last):
  File "src/ubep/bench/torch_systems.py", line 200, in measure_rank
    calls[name] = open_system(name, cfg, work, tokens, stack, opened)
AssertionError: ubep: dispatch on rank 3 differs from the reference"""


def test_a_failed_rank_is_one_line_naming_the_log_that_holds_its_traceback(monkeypatch, capsys):
    """The nested traceback (50 lines and more) goes to a log file; the line names the rank, its
    error and the file; --verbose raises it as before."""
    from ubep.bench import run
    from ubep.launcher import RankFailedError

    def measure(cfg, tokens, systems, progress):
        raise RankFailedError(3, RANK_TRACEBACK)

    monkeypatch.setattr(run, "plan", lambda cfg: (("ubep",), []))
    monkeypatch.setattr(run, "measure", measure)
    argv = ["bench", "--ranks", "4", "--experts", "8", "--tokens", "8"]
    with pytest.raises(SystemExit) as ended:
        main(argv)
    line = str(ended.value.code)
    said = re.fullmatch(
        r"ubep bench: rank 3 failed: AssertionError: ubep: dispatch on rank 3 differs from the reference "
        r"\(the whole traceback: (\S+\.log); --verbose prints it instead\)",
        line,
    )
    assert said, line
    with open(said.group(1)) as log:
        logged = log.read()
    os.unlink(said.group(1))
    assert RANK_TRACEBACK in logged and logged.startswith("Traceback (most recent call last):")
    with pytest.raises(RankFailedError, match="rank 3 failed"):
        main([*argv, "--verbose"])


def test_every_command_has_a_description_and_every_option_its_help_and_default():
    """`simulate` and `plan` had no description in --help, and options had neither help nor default."""
    import argparse

    from ubep.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, command in sub.choices.items():
        if not command.description:
            missing.append(f"{name}: no description")
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {action.option_strings[-1] if action.option_strings else action.dest}"
            if not action.help:
                missing.append(f"{flag}: no help")
            elif not _unset(action.default) and "default" not in action.help:
                missing.append(f"{flag}: no default in its help ({action.default!r})")
    assert missing == []


def _unset(default) -> bool:
    """An option whose default is "not given" (None, a flag's False, nothing), not a value."""
    return default is None or default is False or (isinstance(default, str | tuple) and not default)


def test_the_ablations_print_their_units(capsys):
    """`--ablation headline` printed "-41.3  -52.4": a change in %, said nowhere."""
    from ubep.sim.ablation import PAPER_HEADLINE

    assert main(["simulate", "--ablation", "headline", "--tokens", "8,16"]) == 0
    title, header, _, *rows = capsys.readouterr().out.splitlines()
    assert "change (%)" in title and header.split()[:3] == ["case", "variant", "simulated"]
    shapes = [re.fullmatch(r"EP64 +batch (8|16) +-\d+\.\d%( +-\d+\.\d%)?", row.rstrip()) for row in rows]
    assert all(shapes) and len(rows) == 2, rows
    assert rows[0].split()[-1] == f"{-PAPER_HEADLINE[(64, 8)]:.1f}%"  # the paper's, with its unit


def test_report_on_a_bench_file_without_rich_says_what_the_file_is(without_rich, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"config": {"ranks": 2}, "results": [{"system": "ubep", "dispatch_us": 1.0}]}))
    with pytest.raises(SystemExit) as ended:
        main(["report", str(path)])
    assert str(ended.value.code).startswith(
        f"ubep report: {path} is a bench results file (ubep bench --json); ubep report reads stats files "
        "(written by ubep bench --stats)"
    )


def test_a_prose_column_wraps_within_120_columns_and_keeps_every_word():
    """`ubep plan`'s bottleneck column made lines of 159 columns; a left-aligned last column now
    wraps under itself, and numbers are never cut."""
    from ubep.sim.table import render

    prose = " ".join(f"word{i}" for i in range(60))
    text = render(
        "t", ["tokens", "dispatch us", "why"], [["8", "63.8", prose], ["128", "77.1", "short"]], left=("why",)
    )
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and len(lines) > 5
    assert " ".join(w for ln in lines[3:] for w in ln.split() if w.startswith("word")) == prose
    assert lines[3].split()[:2] == ["8", "63.8"] and lines[4].startswith(" " * 10)  # a continuation
    assert lines[-1].split() == ["128", "77.1", "short"]
    wide = render("t", ["n"], [["9" * 150]])  # a number: whole, however wide
    assert wide.splitlines()[-1] == "9" * 150
