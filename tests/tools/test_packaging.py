"""What a pip install gets: the type-annotation marker and the license, in the wheel built from here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version

from repo import ROOT


def test_the_wheel_ships_py_typed_and_the_apache_license(tmp_path):
    tree = tmp_path / "tree"  # a copy of what the build reads, so that it leaves nothing in the repository
    shutil.copytree(os.path.join(ROOT, "src"), tree / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), tree / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", str(tmp_path), str(tree)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("ubep-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "ubep/py.typed" in names  # PEP 561: type checkers read ubep's annotations
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        text = archive.read(license_file).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_the_changelog_has_a_section_for_this_version():
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        headings = [line.strip() for line in f if line.startswith("## ")]
    assert headings[0] == "## Unreleased" or headings[0].startswith("## " + version("ubep"))
    assert any(h.startswith("## " + version("ubep")) for h in headings)  # bump the version, log it
