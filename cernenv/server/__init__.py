"""CERNenv over OpenEnv's HTTP/WebSocket API: `python -m cernenv.server` serves it,
`cernenv.client.CERNEnvClient` plays it. See `cernenv.server.app` for the routes."""

from cernenv.server.app import ServedEnvironment, create_cernenv_app
from cernenv.server.config import ServerConfig

__all__ = ["ServedEnvironment", "ServerConfig", "create_cernenv_app"]
