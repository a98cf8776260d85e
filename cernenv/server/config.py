"""`ServerConfig`: how the CERNenv server is run (address, mode, limits, secrets), from the
command line, `CERNENV_*` environment variables and defaults (`ServerConfig.from_env`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Tuple

from cernenv.server.evaluation import MODES, fingerprint

ENV_PREFIX = "CERNENV_"
MIN_LEDGER_MAX_MIB = 0.01
"""The smallest `ServerConfig.ledger_max_mib` [MiB] (10 KiB: a few episodes' lines)."""
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _machine_names() -> list:
    """This machine's host name, its fully qualified name and the addresses they resolve to."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        names |= {info[4][0].lower() for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return sorted(names)


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs; each field can be set by the variable CERNENV_<FIELD> (e.g. CERNENV_PORT)."""

    host: str = "127.0.0.1"
    """Interface to bind; the default serves this machine only."""
    port: int = 8000
    """TCP port."""
    mode: str = "evaluation"
    """"evaluation": fresh hidden worlds, grades withheld from the wire and written to the results
    ledger; "training": replayable worlds and rewards served, for training (never for scoring
    outsiders). See `cernenv.server.evaluation`."""
    max_sessions: int = 64
    """Concurrent sessions (WebSocket and MCP, one environment each); one more is refused with CAPACITY_REACHED."""
    max_sessions_per_client: int = 0
    """Concurrent sessions from one client address; 0: a quarter of `max_sessions` in evaluation
    mode (16 of 64), all of them in training mode (one trainer holds every session)."""
    max_message_bytes: int = 64 * 1024
    """Largest request accepted [bytes]: a larger WebSocket message gets an error frame, a larger HTTP body 413.
    An action with the longest justification (2,000 characters) takes under 3 KiB."""
    session_idle_timeout_s: float = 300.0
    """A session whose environment has not reset or stepped for this long [s] is closed (its
    WebSocket with code 1001) and its slot freed: whatever else it sends (`state`, pings) keeps
    no slot."""
    max_connections: int = 1024
    """Open connections, HTTP and WebSocket together. When they are all open, a new one takes the
    place of a waiting connection of the address that holds the most; otherwise it gets a 503.
    Keep it well under the process's file-descriptor limit (`ulimit -n`)."""
    max_connections_per_client: int = 128
    """Open connections from one client address (above `max_sessions`, so one host can fill the
    sessions); one more gets a 503 and is closed."""
    request_read_timeout_s: float = 10.0
    """Time [s] a connection has to deliver a whole HTTP request (headers and body); later, a 408
    and the connection is closed, so unfinished requests cannot hold connections."""
    trusted_proxies: str = ""
    """Comma-separated addresses of reverse proxies whose X-Forwarded-For names the client; from
    anyone else the header is ignored, and every limit is keyed on the connection's peer address."""
    allowed_origins: str = ""
    """Comma-separated origins (e.g. https://lab.example.org) whose browser pages may use the
    server; a request with another `Origin` header than these and the server's own is refused."""
    allowed_hosts: str = ""
    """Comma-separated host names (or addresses) requests may name in their `Host` header besides
    this machine's loopback names and the bound address (for a wildcard bind, the machine's own
    name and addresses); "*" for any. A request naming another host is refused (400): a web page
    that rebinds its own name to 127.0.0.1 (DNS rebinding) cannot use the server."""
    results_ledger: str = ""
    """Where each ended episode's grade and truth are appended (JSON lines); "" for nowhere.
    `python -m cernenv.server` sets it in evaluation mode (see `cernenv.server.evaluation`). With a
    `scored_run`, the run's own ledger: a new file, or a folder for RUN_ID.jsonl."""
    scored_run: str = ""
    """The scored run the server opens at start (`cernenv.server.runs`): a suite version ("v3"),
    one part of it ("v3:unseen"), or a fresh draw ("draw:60"); "" for none. In a scored run every
    reset gets the run's next task, and a reset that names a seed, scenario or difficulty is refused."""
    ledger_max_mib: float = 256.0
    """Size [MiB] at which the results ledger is rotated (8 rotated files are kept beside it), and
    each client address's share of it over the server's life (one address cannot rotate the
    others' lines away). A scored run's ledger, a file of its own, is never rotated."""
    token: str = field(default="", repr=False)
    """Bearer token: when set, every route but /health needs `Authorization: Bearer <token>`
    (the WebSocket too, in its opening handshake). "" serves anyone who can connect: keep the
    default host 127.0.0.1 then. Never printed."""
    secret_salt: str = field(default="", repr=False)
    """Evaluation secret mixed into every session's hidden streams (procedural particles and data),
    so the public code cannot look up an episode's answer from its seed; "" for none. Never
    printed (`secret_fingerprint` names it); a client's own `secret_salt` at reset is mixed in on
    top and cannot remove it."""

    @property
    def evaluation(self) -> bool:
        return self.mode == "evaluation"

    @property
    def sessions_per_client(self) -> int:
        if self.max_sessions_per_client:
            return self.max_sessions_per_client
        return max(1, self.max_sessions // 4) if self.evaluation else self.max_sessions

    @property
    def secret_fingerprint(self) -> Optional[str]:
        return fingerprint(self.secret_salt) if self.secret_salt else None

    @property
    def proxies(self) -> Tuple[str, ...]:
        return tuple(p.strip() for p in self.trusted_proxies.split(",") if p.strip())

    @property
    def origins(self) -> Tuple[str, ...]:
        return tuple(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def hosts(self) -> Tuple[str, ...]:
        """The `Host` names this server answers (see `allowed_hosts`)."""
        named = [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]
        if "*" in named:
            return ("*",)
        hosts = ["127.0.0.1", "localhost", "::1"]
        if self.host in WILDCARD_HOSTS:
            hosts += _machine_names()
            if os.environ.get("SPACE_HOST"):  # a Hugging Face Space's own public name, which it sets
                hosts.append(os.environ["SPACE_HOST"].lower())
        else:
            hosts.append(self.host.strip("[]").lower())
        hosts += [f"[{host}]" for host in hosts if ":" in host]  # an IPv6 address as a Host header writes it
        return tuple(dict.fromkeys(hosts + named))

    @property
    def ws_frame_limit_bytes(self) -> int:
        """Frames above this [bytes] are not even read: the connection closes with code 1009."""
        return max(1024 * 1024, 2 * self.max_message_bytes)

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None, **overrides: Any) -> "ServerConfig":
        """Defaults, then CERNENV_* variables, then `overrides` that are not None."""
        environ = os.environ if environ is None else environ
        values: Dict[str, Any] = {}
        for f in fields(cls):
            text = environ.get(ENV_PREFIX + f.name.upper())
            if text is not None:
                try:
                    values[f.name] = type(f.default)(text)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={text!r} is not a valid {f.name}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        if (
            config.mode not in MODES
            or config.max_sessions < 1
            or not 0 <= config.max_sessions_per_client <= config.max_sessions
            or config.max_message_bytes < 1024
            or not 0 <= config.port < 65536
            or not config.session_idle_timeout_s > 0
            or not config.request_read_timeout_s > 0
            or not 1 <= config.max_connections_per_client <= config.max_connections
            or (config.scored_run and not config.evaluation)
            or not config.ledger_max_mib >= MIN_LEDGER_MAX_MIB
        ):
            raise ValueError(
                f"invalid server configuration {config}: mode one of {', '.join(MODES)}, max_sessions >= 1, "
                "0 <= max_sessions_per_client <= max_sessions, max_message_bytes >= 1024, 0 <= port < 65536, "
                "session_idle_timeout_s > 0, request_read_timeout_s > 0, "
                "1 <= max_connections_per_client <= max_connections, "
                f"ledger_max_mib >= {MIN_LEDGER_MAX_MIB}, and a scored_run in evaluation mode only"
            )
        return config
