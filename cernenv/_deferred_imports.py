"""`import cernenv` without OpenEnv's server stack, and without its web UI unless asked for.

The environment needs two modules of OpenEnv (`openenv.core.env_server.types` and
`.interfaces`), but importing either runs the `__init__` of `openenv.core` and
`openenv.core.env_server`, which import the whole server stack: FastAPI, the MCP server and
fastmcp (~4 s), and, eagerly (inside `try: ... except ModuleNotFoundError`), the Gradio web UI
(~3 s). So:

* `defer_openenv_package_inits` makes those two packages' submodules import at once and runs
  each package's `__init__` only when a name it defines is first asked for (the server's
  `create_app`, a client's `EnvClient`);
* when `openenv.core.env_server`'s `__init__` does run, and `ENABLE_WEB_INTERFACE` is not set,
  a one-shot import hook answers its eager import of the web UI with ModuleNotFoundError (which
  the package expects when Gradio is missing): `create_app` imports the web UI itself when the
  variable asks for it.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

WEB_INTERFACE_MODULE = "openenv.core.env_server.web_interface"
ENABLED_VALUES = ("true", "1", "yes")  # what OpenEnv's create_app accepts for ENABLE_WEB_INTERFACE


class _DeferWebInterface(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != WEB_INTERFACE_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one refusal: the package's eager import at start-up
        raise ModuleNotFoundError(f"{fullname} is imported when ENABLE_WEB_INTERFACE is set (cernenv)", name=fullname)


def _web_interface_enabled() -> bool:
    return os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ENABLED_VALUES


def defer_openenv_web_interface() -> None:
    """Install the one-shot hook, unless the web UI is enabled or already imported."""
    if WEB_INTERFACE_MODULE in sys.modules or _web_interface_enabled():
        return
    if not any(isinstance(finder, _DeferWebInterface) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferWebInterface())


LAZY_PACKAGES = ("openenv.core", "openenv.core.env_server")
"""OpenEnv packages whose `__init__` runs on first use of a name it defines, not on import: both
import the whole server stack (FastAPI, the MCP server, fastmcp: ~4 s), while the environment
needs only two of their modules (`env_server.types`, `env_server.interfaces`)."""


class _RunInitOnFirstUse(importlib.abc.Loader):
    """Makes a package whose submodules import at once, and whose `__init__` runs when a name it
    defines is first asked for (module `__getattr__`, PEP 562: `__path__`, `__name__` and the other
    attributes the import system sets never trigger it)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        loader = self.loader

        def __getattr__(name):
            del module.__dict__["__getattr__"]
            if module.__name__ == "openenv.core.env_server":
                defer_openenv_web_interface()  # its __init__'s eager import of the web UI, refused once
            try:
                loader.exec_module(module)  # the package's own __init__, in this module
            finally:
                for finder in [f for f in sys.meta_path if isinstance(f, _DeferWebInterface)]:
                    sys.meta_path.remove(finder)
            return getattr(module, name)

        module.__getattr__ = __getattr__


class _DeferPackageInits(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in LAZY_PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and spec.submodule_search_locations is not None:
                    spec.loader = _RunInitOnFirstUse(spec.loader)
                return spec
        return None


def defer_openenv_package_inits() -> None:
    """Install the hook, unless OpenEnv's core is already imported."""
    if any(name in sys.modules for name in LAZY_PACKAGES):
        return
    if not any(isinstance(finder, _DeferPackageInits) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferPackageInits())
