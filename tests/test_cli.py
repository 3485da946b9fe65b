"""The `ubep` command line as a new user meets it: without the optional extras, and with bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from ubep.cli import main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))

WITHOUT_NUMBA = """
import contextlib, io, json, sys
sys.modules["numba"] = None  # `import numba` now raises ModuleNotFoundError, as without the `fast` extra
from ubep.cli import main
for argv in ([], ["bench"], ["simulate"], ["plan"], ["decode"]):
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
    ],
)
def test_bad_simulator_arguments_give_one_line_naming_the_problem(tmp_path, argv, said):
    files = {"bad": tmp_path / "bad.json", "partial": tmp_path / "partial.json"}
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


def test_decode_prints_its_table_and_nothing_else():
    """No transformers loading bars (one per model load, in every rank) and no leaked-semaphore
    warning at exit (tqdm's lock in the rank processes)."""
    pytest.importorskip("transformers")  # the `frameworks` extra
    tiny = ["--steps", "1", "--warmup", "1", "--repeats", "1", "--systems", "ubep,all_to_all"]
    env = {k: v for k, v in ENV.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run(
        [sys.executable, "-m", "ubep", "decode", *tiny], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""
    assert done.stdout.splitlines()[1].split()[:2] == ["system", "ms/token"]


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_simulate_and_plan_without_rich_say_which_extra_to_install(monkeypatch, command):
    monkeypatch.setitem(sys.modules, "rich", None)  # as after a plain `pip install ubep`
    with pytest.raises(SystemExit) as done:
        main([command, "--tokens", "8"])
    assert done.value.code == f"ubep {command} needs rich: pip install 'ubep[bench]'"
