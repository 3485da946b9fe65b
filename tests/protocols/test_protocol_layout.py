"""Each protocol's memory is declared once, and its three forms read their places from that declaration.

- The declared word indices (`blocks.py` of each protocol package) are where the transport really
  writes each header field: a header published by name through a heap is read back here by index.
- The numba halves and the Triton kernels index the address table and the header words with the
  declaration's numbers (the Triton constants are read from it), and report its status codes.
- The layout of the code: no module under `ubep.engine` imports a protocol; a protocol package
  imports only its own modules, the shared protocol pieces and the floors below.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import re
from pathlib import Path

import numpy as np
import pytest
import repo

from ubep.calls import CallCounter
from ubep.layout import ExpertPlacement
from ubep.protocols.base import Sizing
from ubep.protocols.bsp import blocks as bsp_blocks
from ubep.protocols.combine import blocks as normal_blocks
from ubep.protocols.ll import blocks as ll_blocks
from ubep.protocols.ubep import blocks as ubep_blocks
from ubep.transport.virtual import VirtualWorld, virtual_heap

SRC = repo.SRC / "ubep"
PACKAGES = ("ubep", "bsp", "ll", "combine")
# What a protocol package may import besides its own modules: the shared protocol pieces and the floors
# below the protocol (docs/design.md's map). `combine` is shared by ubep and bsp.
SHARED = {
    "ubep.protocols.base", "ubep.protocols.halves", "ubep.protocols.device_halves",
}  # fmt: skip
BELOW = {
    "ubep.calls", "ubep.errors", "ubep.faults", "ubep.fp8", "ubep.layout", "ubep.results", "ubep.validate",
    "ubep.waiting", "ubep.schedule", "ubep.topology", "ubep.reference", "ubep.registry",
}  # fmt: skip
FLOORS_BELOW = ("ubep.engine", "ubep.transport")  # never `ubep.across`: the wing above


def _sizing(R: int, experts_per_rank: int = 2) -> Sizing:
    placement = ExpertPlacement.contiguous(experts_per_rank * R, R)
    return Sizing(hidden=256, capacity=4, max_topk=3, placement=placement)


# Per package: (its blocks for a sizing, a header's attribute, {field: the name of its declared word}).
HEADERS = [
    (ubep_blocks, lambda s: ubep_blocks.UbepBlocks.of(s), "route",
     {"num_tokens": "R_NUM", "dtype": "R_DTYPE", "topk": "R_TOPK", "counts": "R_COUNTS"}),
    (normal_blocks, lambda s: normal_blocks.BackBlocks.of("t", s, double=True), "back",
     {"dtype": "B_DTYPE", "topk": "B_TOPK", "prefix": "B_PREFIX"}),
    (bsp_blocks, lambda s: bsp_blocks.BspBlocks.of(s), "counts", {"counts": "C_COUNTS"}),
    (bsp_blocks, lambda s: bsp_blocks.BspBlocks.of(s), "staged", {"dtype": "S_DTYPE", "topk": "S_TOPK"}),
    (ll_blocks, lambda s: ll_blocks.LLBlocks.of(s), "sent",
     {"dtype": "S_DTYPE", "T": "S_T", "width": "S_WIDTH", "counts": "S_COUNTS"}),
    (ll_blocks, lambda s: ll_blocks.LLBlocks.of(s), "returned", {"dtype": "R_DTYPE", "count": "R_COUNT"}),
]  # fmt: skip


@pytest.mark.parametrize("R", [2, 5])
def test_declared_words_are_the_headers_fields(R):
    """Every declared word index names its field, in the Header the statement publishes by name; the
    back header's `dispatch` sits after prefix's R + 1 words, where the halves look for it."""
    s = _sizing(R)
    for module, make, attr, words in HEADERS:
        header = getattr(make(s), attr)
        declared = {field: getattr(module, name) for field, name in words.items()}
        assert {field: header.word(field) for field in words} == declared, (module.__name__, attr)
    back = normal_blocks.BackBlocks.of("t", s, double=True).back
    assert header_fields(back) == normal_blocks.BACK_FIELDS
    assert back.word("dispatch") == normal_blocks.B_PREFIX + R + 1
    assert header_fields(ubep_blocks.UbepBlocks.of(s).route) == ubep_blocks.ROUTE_FIELDS
    assert header_fields(bsp_blocks.BspBlocks.of(s).staged) == bsp_blocks.STAGED_FIELDS
    assert header_fields(ll_blocks.LLBlocks.of(s).sent) == ll_blocks.SENT_FIELDS
    assert header_fields(ll_blocks.LLBlocks.of(s).returned) == ll_blocks.RETURNED_FIELDS


def header_fields(header) -> tuple[str, ...]:
    return tuple(f.name for f in header.fields)


def test_table_order_is_the_declared_order():
    """`table()` lists the blocks in TABLE order, and every block index is its name's place there."""
    s = _sizing(3)
    cases = [
        (ubep_blocks, ubep_blocks.UbepBlocks.of(s)),
        (bsp_blocks, bsp_blocks.BspBlocks.of(s)),
        (ll_blocks, ll_blocks.LLBlocks.of(s)),
        (normal_blocks, normal_blocks.BackBlocks.of("t", s, double=True)),
    ]
    for module, blocks in cases:
        names = [b.name.split(".", 1)[1] for b in blocks.table()]
        assert names == list(module.TABLE), module.__name__
        for name in module.TABLE:
            index = {"done": "DONE_WORDS"}.get(name, name.upper())
            assert getattr(module, index) == module.TABLE.index(name), (module.__name__, name)
        assert set(blocks.table()) <= set(blocks.all())


def _words_at(address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(address)).copy()


def test_a_header_published_by_name_is_read_by_the_declared_words():
    """A route header published through the transport (the statement's path, by field name) holds each
    value at the word the compiled halves read it from (the same address table they use)."""
    R = 3
    s = _sizing(R)

    def publish(rank):
        blocks = ubep_blocks.UbepBlocks.of(s)
        heap = virtual_heap(blocks.all(), rank, 10.0)
        call = CallCounter().next("dispatch").exact()
        counts = [rank.rank + 1, 0, 2 * rank.rank][:R]
        heap.publish(blocks.route, call, {"num_tokens": 4, "dtype": 2, "topk": 3, "counts": counts})
        table, _ = heap.address_table(blocks.table())
        words = _words_at(int(table[rank.rank, ubep_blocks.ROUTE, call.epoch & 1]), 1 + 3 + R)
        heap.close()
        return words, call.epoch, counts

    for words, epoch, counts in VirtualWorld(R).run(publish):
        assert words[0] == epoch
        assert words[ubep_blocks.R_NUM] == 4
        assert words[ubep_blocks.R_DTYPE] == 2
        assert words[ubep_blocks.R_TOPK] == 3
        assert words[ubep_blocks.R_COUNTS : ubep_blocks.R_COUNTS + R].tolist() == counts


def _numbers(module) -> dict[str, int]:
    return {n: v for n, v in vars(module).items() if n.isupper() and isinstance(v, int)}


@pytest.mark.parametrize("package", PACKAGES)
def test_the_numba_halves_take_the_declared_places_and_codes(package):
    """Every upper-case number the numba halves share a name with in the declaration or the codes is the
    declaration's (they import it rather than repeat it)."""
    pytest.importorskip("numba")
    halves = importlib.import_module(f"ubep.protocols.{package}.numba_halves")
    declared = {**_numbers(importlib.import_module(f"ubep.protocols.{package}.blocks")),
                **_numbers(importlib.import_module(f"ubep.protocols.{package}.codes"))}  # fmt: skip
    shared = {n: v for n, v in _numbers(halves).items() if n in declared}
    assert shared == {n: declared[n] for n in shared}
    assert len(shared) >= 5, sorted(shared)  # the halves really index by the declaration


@pytest.mark.parametrize("package", PACKAGES)
def test_the_triton_kernels_take_the_declared_places_and_codes(package):
    """Every Triton constant the kernels use that names a declared place or code has the declaration's
    value, and the table width is the declared table's."""
    tl = pytest.importorskip("triton.language")
    kernels = importlib.import_module(f"ubep.protocols.{package}.triton_halves")
    blocks = importlib.import_module(f"ubep.protocols.{package}.blocks")
    declared = {**_numbers(blocks), **_numbers(importlib.import_module(f"ubep.protocols.{package}.codes"))}
    constants = {n: v.value for n, v in vars(kernels).items() if isinstance(v, tl.constexpr)}
    assert constants["BLOCKS"] == len(blocks.TABLE)
    shared = {n: v for n, v in constants.items() if n in declared}
    assert shared == {n: declared[n] for n in shared}
    assert len(shared) >= 5, sorted(shared)


def _is_module(name: str) -> bool:
    path = SRC.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: Path) -> set[str]:
    """The ubep modules a source file imports, at its top or inside a function (`from ubep.x import y`
    counts ubep.x.y where y is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ubep")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ubep"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            modules = {name for name in names if _is_module(name)}
            found |= modules if len(modules) == len(names) else modules | {node.module}
    return found


@pytest.mark.parametrize("floor", ["engine", "transport", "fabric"])
def test_no_floor_below_imports_a_protocol(floor):
    for path in (SRC / floor).glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("ubep.protocols")}, path.name


@pytest.mark.parametrize("package", PACKAGES)
def test_a_protocol_package_imports_its_own_the_shared_pieces_and_the_floors_below(package):
    own = f"ubep.protocols.{package}"
    allowed_shared = SHARED | ({"ubep.protocols.combine"} if package in ("ubep", "bsp") else set())
    for path in (SRC / "protocols" / package).glob("*.py"):
        for module in _imports(path):
            ok = (
                module == own
                or module.startswith(own + ".")
                or any(module == s or module.startswith(s + ".") for s in allowed_shared)
                or module in BELOW
                or module.startswith(FLOORS_BELOW)
            )
            assert ok, f"{package}/{path.name} imports {module}"


def test_each_package_says_its_blocks_and_halves():
    """A package's docstring names its blocks (module `blocks`) and its halves in the order a call
    runs them: a send half before the half that waits for it."""
    for package in PACKAGES:
        doc = importlib.import_module(f"ubep.protocols.{package}").__doc__ or ""
        at = doc.find("`blocks`")
        assert at >= 0, package
        words = ("send", "reduce", "receive", "routes", "verify")
        first = {w: re.search(rf"\b{w}\b", doc[at:]) for w in words}
        waits = min(m.start() for w, m in first.items() if m and w != "send")
        assert first["send"] and first["send"].start() < waits, package


def test_engine_holds_kernels_only():
    """`ubep.engine` holds the kernel interface, its engines, the sync primitives and compiling the
    kernels once per host: no protocol's halves, codes or status words (they live in their protocol's
    package)."""
    names = sorted(p.stem for p in (SRC / "engine").glob("*.py"))
    assert names == sorted([
        "__init__", "base", "compile_once", "numba_engine", "numba_kernels", "numba_sync", "torch_engine",
        "triton_engine", "triton_kernels", "triton_route", "triton_sync",
    ])  # fmt: skip
