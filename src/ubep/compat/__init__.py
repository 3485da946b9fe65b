"""Drop-in layers for code written against other EP libraries (`ubep.compat.deep_ep`).

`install_as_deep_ep()` lets unchanged framework code (`import deep_ep`,
`from deep_ep.utils import EventOverlap`) run on ubep. It is an explicit opt-in
and never shadows a real DeepEP silently: if one is importable it refuses unless
told `replace_real=True`. `serve_deep_ep_if_missing()` is the lazy form frameworks' plugins use:
`import deep_ep` gets ubep's layer only where no real DeepEP is found (ubep's vLLM plugin, for
vLLM's DeepEP all2all backends). `explain_deep_ep()` says which `deep_ep` is active.
"""

from __future__ import annotations

import importlib
import importlib.abc
import pkgutil
import sys
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

COMPAT_NAME = "ubep.compat.deep_ep"


def _real_deep_ep_origin() -> str | None:
    """Where a real DeepEP is, if one is loaded or installed on sys.path (None if not)."""
    active = sys.modules.get("deep_ep")
    if active is not None and active.__name__ != COMPAT_NAME:
        return getattr(active, "__file__", None) or "already imported"
    spec = PathFinder.find_spec("deep_ep")  # searches sys.path only, past any module installed here
    return None if spec is None else (spec.origin or "a namespace package")


def install_as_deep_ep(replace_real: bool = False) -> str:
    """Make `import deep_ep` and its submodules (`deep_ep.utils`, `deep_ep.utils.event`,
    `deep_ep.buffers.elastic`, ...) give ubep's DeepEP layer; returns `explain_deep_ep()`.

    Raises RuntimeError when a real DeepEP is installed, unless `replace_real=True`.
    """
    real = _real_deep_ep_origin()
    if real is not None and not replace_real:
        raise RuntimeError(
            f"a real DeepEP is installed ({real}); ubep will not shadow it. Use it, or call "
            "install_as_deep_ep(replace_real=True) to run this process's `import deep_ep` on ubep"
        )
    sys.modules.update(deep_ep_modules())
    return explain_deep_ep()


def deep_ep_modules() -> dict[str, ModuleType]:
    """Every module of ubep's DeepEP layer, by the name `import deep_ep...` reaches it under.

    All of them go into `sys.modules` at once: a submodule imported later through the
    `deep_ep` name alone would be loaded a second time, with classes of its own."""
    package = importlib.import_module(COMPAT_NAME)
    found = {"deep_ep": package}
    for info in pkgutil.walk_packages(package.__path__, prefix=COMPAT_NAME + "."):
        found["deep_ep" + info.name.removeprefix(COMPAT_NAME)] = importlib.import_module(info.name)
    return found


class _DeepEPFallback(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The last finder on `sys.meta_path`: reached for `deep_ep...` only when every finder before
    it (a real DeepEP on sys.path among them) found nothing; then serves ubep's layer."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deep_ep" and not fullname.startswith("deep_ep."):
            return None
        modules = deep_ep_modules()
        if fullname not in modules:
            return None
        # the others now; this one through the import system, which stamps a spec of its own on it
        sys.modules.update({name: m for name, m in modules.items() if name != fullname})
        spec = ModuleSpec(fullname, self, is_package=hasattr(modules[fullname], "__path__"))
        spec.loader_state = modules[fullname], modules[fullname].__spec__
        return spec

    def create_module(self, spec):
        return spec.loader_state[0]

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state[1]  # its own spec back (it is already executed)


def serve_deep_ep_if_missing() -> None:
    """Make a later `import deep_ep` give ubep's DeepEP layer if, and only if, no real DeepEP is
    found then (the finder goes last on `sys.meta_path`); idempotent. Unlike
    `install_as_deep_ep()` it imports nothing now and never shadows a real DeepEP."""
    if not any(isinstance(finder, _DeepEPFallback) for finder in sys.meta_path):
        sys.meta_path.append(_DeepEPFallback())


def explain_deep_ep() -> str:
    """Which `deep_ep` an `import deep_ep` gives in this process, and why."""
    active = sys.modules.get("deep_ep")
    if active is not None and active.__name__ == COMPAT_NAME:
        real = _real_deep_ep_origin()
        return "deep_ep is ubep's DeepEP layer (ubep.compat.deep_ep), installed by install_as_deep_ep()" + (
            "" if real is None else f"; a real DeepEP at {real} is shadowed"
        )
    origin = _real_deep_ep_origin()
    if origin is not None:
        return f"deep_ep is the real DeepEP ({origin}); ubep is not installed as deep_ep"
    return "no deep_ep is importable; call ubep.compat.install_as_deep_ep() to serve it from ubep"
