"""scripts/setup.sh says what it does at each step (it was silent for about 105 of its 141 s), run
here against stand-ins for python3, pip, ubep and mpicc that install nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from repo import ROOT

STAND_INS = {
    "python3": """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Python 3.11.2"; exit 0; fi
mkdir -p .venv/bin  # python3 -m venv .venv
for tool in pip ubep; do printf '#!/bin/sh\\necho "%s $*" >>calls\\n' "$tool" >".venv/bin/$tool"; done
printf '#!/bin/sh\\necho torch 2.13.0\\n' >.venv/bin/python
chmod +x .venv/bin/*
""",
    "mpicc": "#!/bin/sh\nexit 0\n",  # Open MPI present: nothing is installed from Debian's packages
}


def test_setup_says_each_step_and_its_time(tmp_path):
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), clone / "scripts" / "setup.sh")
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in STAND_INS.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["1/6", "2/6", "3/6", "4/6", "5/6", "6/6", "done:"], lines
    assert all(re.fullmatch(r"setup: .* \(\d+ s\)", line) for line in lines), lines
    assert "Open MPI is here" in lines[0] and "Python 3.11.2" in lines[1] and "ubep warm" in lines[5]
    assert "torch 2.13.0" in lines[-1] and ".venv/bin/ubep" in lines[-1]
    calls = (clone / "calls").read_text().splitlines()  # each step ran what it said
    assert calls[-1] == "ubep warm" and any(c.startswith("pip install -q -e .[dev,") for c in calls)
