"""Build ubep's API reference, HTML generated from the docstrings by pdoc (the `dev` extra).

    python scripts/api_docs.py [OUT]        # default: build/api; open OUT/index.html

The pages cover the public modules below. Any pdoc warning fails the build (a
module that does not import, a broken cross-reference), except one pdoc cannot
resolve: the field types of a NamedTuple's generated `__init__`, which it looks
up in the wrong namespace (the fields themselves are documented with their types).
tests/tools/test_api_docs.py runs this build.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

PUBLIC_MODULES = (
    "ubep",  # Buffer, its results and handles, errors, LocalLaunch, EventOverlap, fp8
    "ubep.compat",  # DeepEP's API (ubep.compat.deep_ep) and install_as_deep_ep
    "ubep.integrations.transformers",
    "ubep.transport.virtual",  # VirtualWorld: ranks as threads, for tests
    "ubep.sizing",  # size_hint
    "ubep.faults",  # FaultPlan
    "ubep.reference",  # the plain-torch semantics every transport is checked against
    "ubep.layout",  # the shape legend, ExpertPlacement
    "ubep.topology",  # fabrics for the simulator and `ubep plan`
    "ubep.schedule",  # the token scheduler's policies
    "ubep.placement",  # expert placement by load and distance, EPLB baseline, the nearest-copy map
    "ubep.timers",  # the call timers (Buffer(call_timers=True))
)
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "build" / "api"


def build(out: Path) -> Path:
    """Write the reference into `out`; returns its index page. Raises RuntimeError on a pdoc warning."""
    import pdoc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*PUBLIC_MODULES, output_directory=out)
    problems = [str(w.message) for w in caught if not _namedtuple_init(str(w.message))]
    if problems:
        raise RuntimeError("pdoc warned:\n" + "\n".join(problems))
    return out / "index.html"


def _namedtuple_init(message: str) -> bool:
    return message.startswith("Error parsing type annotation") and "Result.__init__" in message


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT))
