"""CERNenv over OpenEnv's HTTP/WebSocket API: `python -m cernenv.server` serves it,
`cernenv.client.CERNEnvClient` plays it. See `cernenv.server.app` for the routes.

The names below are loaded on first use: importing one of the package's light modules
(`cernenv.server.pacing`, `.scheduler`, `.config`) does not start OpenEnv's server stack."""

from __future__ import annotations

from typing import Any

__all__ = ["ServedEnvironment", "ServerConfig", "create_cernenv_app"]


def __getattr__(name: str) -> Any:
    if name == "ServerConfig":
        from cernenv.server.config import ServerConfig

        return ServerConfig
    if name in ("ServedEnvironment", "create_cernenv_app"):
        from cernenv.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'cernenv.server' has no attribute {name!r}")
