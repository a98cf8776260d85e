"""Free local ports for the servers a command (or a test) starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port the kernel hands out for bind(0)
    is also one it may pick as a connection's source port: a client polling it before the
    server listens can then connect to itself (TCP self-connect) and read its own request back
    as the answer (`BadStatusLine: GET /health HTTP/1.1`, seen under load)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in [10000, {low})")
