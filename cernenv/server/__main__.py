"""`python -m cernenv.server [--host H] [--port P] [--max-sessions N] [--max-message-bytes B] ...`.

Each flag overrides its CERNENV_* variable (CERNENV_HOST, CERNENV_PORT, ...), which
overrides the default in `ServerConfig` (127.0.0.1:8000, 64 sessions, 64 KiB messages).
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path
from typing import List, Optional

import uvicorn

from cernenv.physics.scan import warm_up
from cernenv.server.app import ServerConfig, create_cernenv_app
from cernenv.server.guard import ConnectionGuard, guarded_protocols, listening_socket

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _read_secret(parser: argparse.ArgumentParser, path: Optional[Path], flag: str) -> Optional[str]:
    """The stripped content of a secret's file (None without the flag); a clear error if unusable."""
    if path is None:
        return None
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"cannot read {flag} {path}: {error}")
    if not secret:
        parser.error(f"{flag} {path} is empty: write the secret in it")
    return secret


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cernenv.server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="TCP port (default 8000)")
    parser.add_argument("--max-sessions", type=int, help="concurrent WebSocket sessions (default 64)")
    parser.add_argument("--max-message-bytes", type=int, help="largest accepted message (default 65536)")
    parser.add_argument(
        "--secret-salt-file",
        type=Path,
        metavar="PATH",
        help="file holding the evaluation secret (or set CERNENV_SECRET_SALT): mixed into the "
        "hidden particles and data, so the public code cannot look answers up by seed",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="file holding a bearer token (or set CERNENV_TOKEN): then every route but /health "
        "needs 'Authorization: Bearer <token>'; required to bind beyond 127.0.0.1 safely",
    )
    parser.add_argument(
        "--session-idle-timeout-s", type=float, help="close a WebSocket session idle this long (default 300)"
    )
    parser.add_argument(
        "--max-connections", type=int, help="open connections in all (default 1024; keep it under `ulimit -n`)"
    )
    parser.add_argument(
        "--max-connections-per-client", type=int, help="open connections from one address (default 128)"
    )
    parser.add_argument(
        "--request-read-timeout-s", type=float, help="time a connection has to send a whole HTTP request (default 10)"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    args = parser.parse_args(argv)
    secret = _read_secret(parser, args.secret_salt_file, "--secret-salt-file")
    token = _read_secret(parser, args.token_file, "--token-file")
    try:
        config = ServerConfig.from_env(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            max_message_bytes=args.max_message_bytes,
            secret_salt=secret,
            token=token,
            session_idle_timeout_s=args.session_idle_timeout_s,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            request_read_timeout_s=args.request_read_timeout_s,
        )
    except ValueError as error:
        parser.error(str(error))
    if not config.token and config.host not in LOOPBACK_HOSTS:
        print(
            f"WARNING: serving {config.host} without a token: anyone who can reach this port can open sessions "
            "and use its CPU; set --token-file or CERNENV_TOKEN",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"CERNenv server on http://{config.host}:{config.port} (WebSocket /ws, at most {config.max_sessions} "
        f"sessions, messages up to {config.max_message_bytes} bytes"
        f"{', with an evaluation secret' if config.secret_salt else ''}"
        f"{', bearer token required' if config.token else ''})",
        file=sys.stderr,
        flush=True,
    )
    needed = config.max_connections + 64  # with room for the server's own files
    soft_limit, hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit != resource.RLIM_INFINITY and soft_limit < needed:
        if hard_limit == resource.RLIM_INFINITY or hard_limit >= needed:  # a soft limit any process may raise
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard_limit))  # (containers often start at 1024)
        else:
            parser.error(
                f"--max-connections {config.max_connections} does not fit under this process's limit of "
                f"{hard_limit} open files (ulimit -Hn) with room for the server's own: lower it or raise "
                f"the limit"
            )
    warm_up()  # the physics kernels compiled (or loaded) before /health answers, not at a first step
    guard = ConnectionGuard(config.max_connections, config.max_connections_per_client, config.request_read_timeout_s)
    try:  # a taken port: say which, and how to choose another (uvicorn only logs "[Errno 98]")
        listener = listening_socket(guard, config.host, config.port)
    except OSError as error:
        parser.error(
            f"cannot listen on {config.host}:{config.port} ({error.strerror}): another server may hold "
            f'that port; pick another with --port N (or CERNENV_PORT; `make serve SERVE_ARGS="--port N"`)'
        )
    http, ws = guarded_protocols(guard)
    server = uvicorn.Server(
        uvicorn.Config(
            create_cernenv_app(config),
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            http=http,
            ws=ws,
            ws_max_size=config.ws_frame_limit_bytes,
            ws_per_message_deflate=False,
        )
    )
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
