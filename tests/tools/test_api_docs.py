"""The API reference builds from the docstrings (pdoc, the `dev` extra), with no pdoc warning."""

from __future__ import annotations

import pytest

pytest.importorskip("pdoc", reason="the API reference is built with pdoc, from the dev extra")

import api_docs  # scripts/, on the path from conftest.py


def test_the_api_reference_builds_from_the_docstrings(tmp_path):
    index = api_docs.build(tmp_path)
    assert index.is_file()
    top = (tmp_path / "ubep.html").read_text()
    assert "Dispatch/combine for one EP group; construct it on every rank" in top  # Buffer's docstring
    assert "low_latency_dispatch" in top
    compat = (tmp_path / "ubep" / "compat" / "deep_ep.html").read_text()
    assert "get_local_buffer_tensor" in compat
    for module in api_docs.PUBLIC_MODULES:
        assert (tmp_path / (module.replace(".", "/") + ".html")).is_file(), module
