"""Local ports for the servers tests start (`lib.ports`)."""

from lib.ports import free_port

__all__ = ["free_port"]
