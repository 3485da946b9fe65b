"""Optional dependencies: the one way ubep words how to install an extra, and a check that says so
before a command starts its work.

ubep is on no package index. It installs from a clone (`pip install .`, or `pip install '.[bench]'`
with an extra) or from a wheel built there, so every hint names the extra in that form.
"""

from __future__ import annotations

import importlib.util


def install_hint(extra: str) -> str:
    """How to get an extra, as every message of ubep words it."""
    return f"the {extra!r} extra: pip install '.[{extra}]' in ubep's clone"


def require(what: str, module: str, extra: str) -> None:
    """SystemExit with one line naming `module` and its extra when it is not installed; call it
    before doing anything, so that no half-done output precedes the refusal."""
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"{what} needs {module} ({install_hint(extra)})")
