"""The `ubep` command line as a new user meets it: without the optional extras, and with bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version

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
