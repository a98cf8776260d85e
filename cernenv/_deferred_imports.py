"""Start-up without OpenEnv's web UI unless it is asked for.

`openenv.core.env_server`'s package `__init__` imports its Gradio web interface eagerly
(inside `try: ... except ModuleNotFoundError`), which made `import cernenv` take 6.3 s, about
3 s of it Gradio, in every process: the server, each notebook kernel, each test worker. The
web UI is only built when `ENABLE_WEB_INTERFACE` is true, and then `create_app` imports
`web_interface` itself. So, unless that variable is set, a one-shot import hook answers the
package's eager import with ModuleNotFoundError (which the package expects when Gradio is
missing) and removes itself: a later import, such as `create_app`'s, loads it as usual.
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


def defer_openenv_web_interface() -> None:
    """Install the hook, unless OpenEnv is already imported or its web UI is enabled."""
    if "openenv.core.env_server" in sys.modules:
        return
    if os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ENABLED_VALUES:
        return
    if not any(isinstance(finder, _DeferWebInterface) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferWebInterface())
