"""One registry of names (`ubep.registry`): no module compares a protocol, transport, engine or
fabric name as a string literal, and every place that lists the choices lists the registry's."""

from __future__ import annotations

import argparse
import ast
import pathlib
from types import SimpleNamespace

import pytest

import ubep
from ubep import cli, registry, schedule, settings
from ubep.across.fabric import open_fabric
from ubep.factory import HEAP_PROTOCOLS, HEAPS
from ubep.layout import ExpertPlacement
from ubep.protocols import halves
from ubep.protocols.base import Sizing
from ubep.protocols.warmup import NORMAL
from ubep.sim import commands
from ubep.transport.base import Header

pytestmark = pytest.mark.timeout(60)

PACKAGE = pathlib.Path(ubep.__file__).parent
EXEMPT = ("registry.py",)  # where the names are declared
NAMES = frozenset(
    name
    for table in (registry.PROTOCOLS, registry.TRANSPORTS, registry.ENGINES, registry.FABRICS)
    for name in table
)


def _constants(node: ast.AST) -> list[str]:
    """The string constants of one side of a comparison: a literal, or a tuple, list or set of them."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _is_device_type(node: ast.AST) -> bool:
    """`x.type` or `device_type` (a torch device's kind, "cuda" or "cpu"): a device, not a transport."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("type", "device_type")
    return isinstance(node, ast.Name) and node.id == "device_type"


def _patterns(pattern: ast.pattern) -> list[str]:
    """The string literals a `case` pattern matches (alternatives included)."""
    if isinstance(pattern, ast.MatchValue):
        return _constants(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return [v for p in pattern.patterns for v in _patterns(p)]
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _patterns(pattern.pattern)
    return []


def name_compares(source: str) -> list[tuple[int, str]]:
    """(line, code) of every `==`, `!=`, `in`, `not in` and `case` in `source` that tests a value
    against a registered name spelled as a literal (not against a torch device's `.type`)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_device_type(s) for s in sides):
                continue
            if any(value in NAMES for s in sides for value in _constants(s)):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and not _is_device_type(node.subject):
            for case in node.cases:
                if NAMES.intersection(_patterns(case.pattern)):
                    hits.append((case.pattern.lineno, f"case {ast.unparse(case.pattern)}"))
    return hits


def test_no_module_compares_a_registered_name_as_a_literal():
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {code}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() not in EXEMPT
        for line, code in name_compares(path.read_text())
    ]
    assert not found, "compare with a spec of ubep.registry (its name or a capability):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'ok = transport == "shm"',
        'ok = "numba" != engine.name',
        'ok = t in ("dist", "hier")',
        'ok = fabric not in ["nixl"]',
        'match p:\n    case "bsp":\n        pass',
        'match p:\n    case "auto" | "triton":\n        pass',
    ],
)
def test_the_rule_finds_each_form_of_literal_compare(source):
    assert len(name_compares(source)) == 1, source


@pytest.mark.parametrize(
    "source",
    [
        'ok = x.device.type == "cuda"',  # a torch device, not the transport
        "ok = transport == SHM.name",
        'ok = mode == "normal"',  # not a registered name
        'table = {"ubep": 1}',  # naming is not comparing
    ],
)
def test_the_rule_leaves_other_code_alone(source):
    assert name_compares(source) == []


def test_settings_list_the_registry_choices():
    table = {
        "transport": registry.choices(registry.TRANSPORTS),
        "protocol": registry.choices(registry.PROTOCOLS, auto=False),
        "engine": registry.choices(registry.ENGINES),
        "fabric": registry.choices(registry.FABRICS),
    }
    assert table["transport"] == (
        "auto",
        "shm",
        "cuda",
        "dist",
        "hier",
        "tiers",
        "virtual",
    )  # users pass these
    assert table["protocol"] == ("ubep", "bsp")
    assert table["engine"] == ("auto", "torch", "numba", "triton")
    assert table["fabric"] == ("auto", "gloo", "zmq", "nixl")
    for option, allowed in table.items():
        variable, parse, default = settings.BUFFER_SETTINGS[option]
        assert default == allowed[0]
        assert [parse(name) for name in allowed] == list(allowed)
        with pytest.raises(ValueError, match=f"{variable}='bogus': expected one of ") as caught:
            settings.resolve({}, {variable: "bogus"})
        assert str(caught.value).endswith(str(allowed))


@pytest.mark.parametrize(
    "option,allowed",
    [
        ("protocol", registry.choices(registry.PROTOCOLS, auto=False)),
        ("engine", registry.choices(registry.ENGINES)),
        ("transport", registry.choices(registry.TRANSPORTS)),
        ("schedule", schedule.POLICIES),
    ],
)
def test_buffer_validation_lists_the_registry_choices(option, allowed):
    kwargs = {"engine": "torch", option: "bogus"}  # the torch engine: nothing to compile first
    with pytest.raises(ValueError) as caught:
        ubep.Buffer(hidden=128, num_experts=2, max_tokens_per_rank=2, **kwargs)
    assert str(caught.value) == f"{option} must be one of {allowed}, got 'bogus'"


def test_fabric_validation_lists_the_registry_choices():
    with pytest.raises(ValueError) as caught:
        open_fabric("bogus", None, 0, 2, (), 1.0)
    assert str(caught.value) == f"fabric must be one of {registry.choices(registry.FABRICS)}, got 'bogus'"


def test_cli_choices_are_the_registry_and_schedule_names():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.add_bench(sub)
    commands.add_parser(sub)
    bench = {a.dest: a for a in sub.choices["bench"]._actions}
    simulate = {a.dest: a for a in sub.choices["simulate"]._actions}
    assert tuple(bench["schedule"].choices) == schedule.POLICIES
    simulated = simulate["protocol"].type(",".join(registry.PROTOCOLS))  # every library protocol simulates
    assert simulated == list(registry.PROTOCOLS)
    assert simulate["policy"].type("ubep,distance-paper,bsp") == ["distance", "distance-paper", "bsp"]
    assert simulate["policy"].default == ["distance"]


def test_tables_keyed_by_name_cover_the_registry():
    protocols = set(registry.choices(registry.PROTOCOLS, auto=False))
    assert set(HEAP_PROTOCOLS) == protocols == set(NORMAL)
    assert set(HEAPS) == {name for name, spec in registry.TRANSPORTS.items() if spec.heap}


@pytest.mark.parametrize("protocol", registry.choices(registry.PROTOCOLS, auto=False))
def test_device_headers_are_headers_of_the_protocols_blocks(protocol):
    sizing = Sizing(hidden=128, capacity=2, max_topk=2, placement=ExpertPlacement.contiguous(4, 2))
    headers = {b.name for b in HEAP_PROTOCOLS[protocol][0].of(sizing).all() if isinstance(b, Header)}
    assert set(registry.PROTOCOLS[protocol].device_headers) <= headers
    assert registry.PROTOCOLS[protocol].device_headers  # every protocol's Triton halves poll some


@pytest.mark.parametrize("engine,form", [("numba", "numba"), ("triton", "triton"), ("torch", None)])
def test_compiled_form_follows_the_engines_capabilities(engine, form):
    built = halves.compiled_form(SimpleNamespace(name=engine), lambda: "numba", lambda: "triton")
    assert built == form
