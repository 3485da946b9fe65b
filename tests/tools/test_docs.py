"""The docs say what the code and the repository hold: counts, names, claims, figures and sources."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest
from repo import ROOT

import ubep
from ubep import registry
from ubep.factory import heap_blocks
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Sizing
from ubep.sim import ablation, calibrate


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_figure_the_simulator_compares_against_is_in_the_repository_with_its_source():
    figures = _flat(_read("docs", "paper_figures.md"))
    published = [
        *ablation.PAPER_SCHEDULING_US.values(),
        *ablation.PAPER_SYNC_RANGE,
        *ablation.PAPER_HEADLINE.values(),
        ablation.PAPER_EP128_MEAN_8_64,
        *calibrate.TRTLLM_NVL72_EP8_US,
    ]
    for value in published:
        assert f"{value:.1f}" in figures, value
    eps = sorted(calibrate.DEEPEP_LL_US)
    assert f"| EP | {' | '.join(map(str, eps))} |" in figures
    for half, name in enumerate(("dispatch", "combine")):
        values = " | ".join(f"{calibrate.DEEPEP_LL_US[ep][half]:g}" for ep in eps)
        assert f"| {name} (us) | {values} |" in figures
    for source in ("arXiv 2607.06202", "arXiv 2506.12708", "deepseek-ai/DeepEP", "TensorRT-LLM"):
        assert source in figures
    cited = []
    for folder in ("src", "docs"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            cited += [f for f in files if f.endswith((".py", ".md")) and "PAPER.md" in _read(base, f)]
    assert cited == []  # the paper's figures live in docs/paper_figures.md, not in a file we lack


def test_the_transformers_module_lists_what_it_registers():
    module = pytest.importorskip("ubep.integrations.transformers")  # the `frameworks` extra
    from transformers.distributed.expert_parallel import EPImplementationInterface

    listed = tuple(re.findall(r'^    "(\w+)" ', module.__doc__, re.MULTILINE))
    assert listed == module.IMPLEMENTATIONS
    assert set(listed) <= set(EPImplementationInterface._global_mapping)
    assert not re.search(r"\b(two|three|five) implementations", module.__doc__)


def test_the_decode_claim_holds_in_the_runs_it_cites():
    """docs/frameworks.md claims ubep below the all-to-all only where its table shows it."""
    text = _read("docs", "frameworks.md")
    row = next(line for line in text.splitlines() if line.startswith("| `ubep` (normal mode"))
    ratios = [float(r) for r in row.rstrip(" |").rsplit("|", 1)[1].split(",")]
    assert len(ratios) == 4 and max(ratios) < 1
    flat = _flat(text)
    assert "below the built-in all-to-all's in every run" not in flat
    assert "in each of the four runs above" in flat and "It does not hold in every run" in flat


def test_the_readme_states_the_test_count_and_how_to_get_torch_for_cpu():
    readme = _flat(_read("README.md"))
    stated = int(re.search(r"\(about ([\d,]+) tests\)", readme).group(1).replace(",", ""))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    collected = int(re.search(r"(\d+) tests? collected", done.stdout).group(1))
    assert 0.85 * stated <= collected <= 1.15 * stated, (stated, collected)
    assert "pip install torch --index-url <PyTorch's CPU wheel index>" in readme


def _stated_signature(text: str) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) of each parameter a `Buffer(...)` text states (`inspect.Parameter.empty`
    where it states none), parsed as Python."""
    args = ast.parse(f"def f({' '.join(text.split())}): pass").body[0].args
    positional = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults)) + args.defaults
    kw_only = [inspect.Parameter.empty if d is None else d for d in args.kw_defaults]  # None: no default
    return [
        *(
            (a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d)
            for a, d in zip(args.args, positional, strict=True)
        ),
        *((a.arg, inspect.Parameter.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, kw_only, strict=True)),
    ]


def test_the_readme_states_buffers_signature_as_the_code_has_it():
    stated_text = re.search(r"- `Buffer\((group=None, \*.*?)\)`:", _read("README.md"), re.S).group(1)
    stated = [
        (name, kind, d if d is inspect.Parameter.empty else ast.literal_eval(d))
        for name, kind, d in _stated_signature(stated_text)
    ]
    actual = [(p.name, p.kind, p.default) for p in inspect.signature(ubep.Buffer).parameters.values()]
    assert stated == actual


# --- every path and module the docs name is there ----------------------------------------------------

# Files of other projects that docs/frameworks.md cites (DeepEP's, vLLM's, SGLang's): not ours to find.
FOREIGN = ("deep_ep/", "vllm/", "sglang/", "tests/elastic/")
# Where a path in backticks may start: the repository, src/, or the package (the code map in
# docs/design.md says `protocols/ubep/exchange.py`).
BASES = ("", "src", os.path.join("src", "ubep"))


def _doc_files() -> list[str]:
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", *(os.path.join("docs", f) for f in docs)]


def _backticked(text: str) -> list[tuple[int, str]]:
    """(line, word) for every word inside a `...` span (which may wrap a line; fenced blocks are
    not spans), split at spaces, commas, brackets and quotes."""
    text = re.sub(r"^ *```.*?^ *```", lambda block: "\n" * block.group().count("\n"), text, flags=re.S | re.M)
    words = []
    for span in re.finditer(r"`([^`]+)`", text):
        line = text.count("\n", 0, span.start()) + 1
        words += [(line, w.rstrip(".;")) for w in re.split(r"[\s,()\[\]=:'\"]+", span.group(1)) if w]
    return words


def missing_paths(text: str) -> list[tuple[int, str]]:
    """Paths in backticks (a word with a slash that ends in .py, .md, .sh or /) that are nowhere
    under BASES; placeholders (`protocols/<name>/`), absolute paths and FOREIGN ones are skipped."""
    missing = []
    for line, word in _backticked(text):
        if "/" not in word or not word.endswith((".py", ".md", ".sh", "/")):
            continue
        if re.search(r"[<>*{}$~|]", word) or word.startswith(("/", ".", "http")) or word.startswith(FOREIGN):
            continue
        if not any(os.path.exists(os.path.join(ROOT, base, word)) for base in BASES):
            missing.append((line, word))
    return missing


def _resolves(dotted: str) -> bool:
    """`dotted` is a module of ubep, or a name in one (`ubep.across.fabric.base.Fabric`)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a part before it is no package
            found = False
        if not found:
            continue
        try:
            thing = importlib.import_module(name)
        except ImportError:  # it is there, and needs an extra this environment lacks
            return True
        for attribute in parts[i:]:
            if not hasattr(thing, attribute):
                return False
            thing = getattr(thing, attribute)
        return True
    return False


def _heap_block_names() -> frozenset[str]:
    """The names of the blocks the protocols declare on a heap (`ubep.back`): words, not modules."""
    sizing = Sizing(hidden=128, capacity=1, max_topk=1, placement=ExpertPlacement.contiguous(2, 2))
    return frozenset(b.name for p in registry.PROTOCOLS for b in heap_blocks(sizing, p, low_latency=True))


def unresolved_names(text: str) -> list[tuple[int, str]]:
    """Dotted `ubep.x.y` names in backticks that name no module of ubep, nor anything in one (a heap
    block's name, `ubep.route`, is no module and not looked for)."""
    blocks = _heap_block_names()
    return [
        (line, word)
        for line, word in _backticked(text)
        if re.fullmatch(r"ubep(\.\w+)+", word) and word not in blocks and not _resolves(word)
    ]


def test_every_path_the_docs_name_exists():
    missing = {f: found for f in _doc_files() if (found := missing_paths(_read(f)))}
    assert missing == {}


def test_every_ubep_module_the_docs_name_imports():
    unresolved = {f: found for f in _doc_files() if (found := unresolved_names(_read(f)))}
    assert unresolved == {}


def test_the_checks_find_a_moved_path_and_a_moved_module():
    """What the two tests above would have said before the layout's docs were brought up to date."""
    text = (
        "the exchange (`protocols/ubep/statement.py`), the segments (`src/ubep/shm.py`),\n"
        "`collectives/`, the fabric (`ubep.fabric.base.Fabric`), `ubep.across.fabric.base.Nothing`;\n"
        "found: `protocols/ubep/exchange.py`, `src/ubep/transport/segments.py`, `tests/tools/`,\n"
        "`ubep.across.fabric.base.Fabric`, `ubep.fp8.quantize`, `protocols/<name>/blocks.py`,\n"
        "DeepEP's `deep_ep/buffers/legacy.py`, the header `ubep.back`"
    )
    assert missing_paths(text) == [
        (1, "protocols/ubep/statement.py"),
        (1, "src/ubep/shm.py"),
        (2, "collectives/"),
    ]
    assert unresolved_names(text) == [(2, "ubep.fabric.base.Fabric"), (2, "ubep.across.fabric.base.Nothing")]


# --- a newcomer's commands: the environment, the signatures, today's numbers ----------------------

# A command a reader would type without `.venv/bin/` before it: setup makes .venv but does not
# activate it, and the system's python has no torch.
BARE = re.compile(
    r"(?<![\w/.=-])(ubep (bench|simulate|plan|decode|report|warm)( [-\w]|$)"  # with its arguments
    r"|python3? (examples|scripts)/|python3? -m )"
)
ACTIVATE = "source .venv/bin/activate"


def bare_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) for each command typed without `.venv/bin/` (`BARE`)."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in BARE.finditer(line)]


def test_the_readme_types_every_command_with_its_venv_and_each_doc_says_how_to_activate():
    """The README writes `.venv/bin/ubep ...`; a doc page that writes a bare `ubep bench` or
    `python scripts/...` says once how to activate the environment those mean."""
    readme = _read("README.md")
    assert bare_commands(readme) == [] and ACTIVATE in _flat(readme)
    unexplained = [f for f in _doc_files()[1:] if bare_commands(_read(f)) and ACTIVATE not in _flat(_read(f))]
    assert unexplained == []


def test_the_bare_command_check_finds_what_it_should():
    text = "run `ubep bench --tokens 8`\n    python scripts/soak.py\n"
    text += ".venv/bin/ubep plan x, `.venv/bin/python -m pytest`"
    assert bare_commands(text) == [(1, "ubep bench -"), (2, "python scripts/")]
    said = bare_commands("the `ubep bench` table (a name); `PYTHONPATH=src python -m pytest`")
    assert said == [(1, "python -m ")]  # an environment variable is no venv


def test_the_readme_states_local_launchs_signature_as_the_code_has_it():
    stated_text = re.search(r"- `ubep\.LocalLaunch\((.*?)\)`:", _read("README.md"), re.S).group(1)
    stated = [  # world_size=N: N is the reader's, a name
        (name, d.id if isinstance(d, ast.Name) else ast.literal_eval(d))
        for name, _, d in _stated_signature(f"*, {stated_text}")
    ]
    fields = inspect.signature(ubep.LocalLaunch).parameters.values()
    assert stated == [(p.name, "N" if p.default is inspect.Parameter.empty else p.default) for p in fields]


def test_the_readme_shows_the_import_line_deepep_code_needs():
    line = "from ubep.compat.deep_ep import Buffer, EventOverlap"
    assert f"{line}   # was: from deep_ep import Buffer, EventOverlap" in _read("README.md")
    namespace: dict = {}
    exec(line, namespace)  # the line works as written
    assert namespace["Buffer"].__module__.startswith("ubep.compat.deep_ep")


def test_todays_numbers_are_the_table_the_script_prints_from_the_results_files():
    """docs/benchmarks.md opens with the table scripts/results_table.py prints from docs/results/:
    a results file added without the table, or a table edited by hand, fails here."""
    from ubep.bench.results import BEGIN, END

    doc = _read("docs", "benchmarks.md")
    assert doc.index("## Today's numbers") < doc.index(BEGIN) < doc.index("## How the bench measures")
    in_doc = doc.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    printed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "results_table.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")),
    )
    assert printed.returncode == 0, printed.stderr
    assert in_doc == printed.stdout.strip()
    assert "| `ubep bench --tokens 8,128` |" in in_doc  # the default run leads
    readme = _read("README.md")
    assert "[docs/benchmarks.md](docs/benchmarks.md#todays-numbers)" in readme
