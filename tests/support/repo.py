"""Where this checkout's parts are, for tests that read its files or start a Python of their own.

The test files sit one folder down, by concern (tests/api, tests/reliability, ...), and may move
again: none of them works out the repository from its own path, they import these names instead.
A child Python that imports a test helper by name (`python -c`, a script, a torchrun job) needs
SUPPORT on its PYTHONPATH, as pyproject.toml's `pythonpath` puts it on pytest's.
"""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
SRC = ROOT / "src"
