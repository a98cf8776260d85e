"""`python -m cernenv.server [--mode evaluation|training] [--host H] [--port P] ...`: the one way to
serve CERNenv (`make serve` and the container run it too).

Each flag overrides its CERNENV_* variable (CERNENV_HOST, CERNENV_PORT, CERNENV_MODE, ...), which
overrides the default in `ServerConfig` (127.0.0.1:8000, evaluation mode, 64 sessions, 64 KiB
messages). In evaluation mode the server holds an evaluation secret (--secret-salt-file, or
CERNENV_SECRET_SALT, or one generated on first use in the state directory) and writes each
ended episode's grade to the results ledger; `--mode training` serves rewards and replayable
worlds instead, for training only.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import secrets
import signal
import sys
from pathlib import Path
from typing import List, Optional

from cernenv.physics.scan import warm_up
from cernenv.server.app import create_cernenv_app
from cernenv.server.config import ServerConfig
from cernenv.server.evaluation import (
    MODES,
    RUNS_DIR,
    generated_secret,
    ledger_path,
    private_dir,
    secret_path,
    state_dir,
)
from cernenv.server.guard import ConnectionGuard, guarded_server, listening_socket
from cernenv.server.pacing import events
from cernenv.suite import SELECTION_HELP, is_development, selected_tasks

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m cernenv.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        help="evaluation (default): fresh hidden worlds, grades withheld and written to the results ledger; "
        "training: rewards served and worlds replayable by seed (never for scoring outsiders)",
    )
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="TCP port (default 8000)")
    parser.add_argument("--max-sessions", type=int, help="concurrent sessions, WebSocket and MCP (default 64)")
    parser.add_argument(
        "--max-sessions-per-client",
        type=int,
        help="concurrent sessions from one address (default: a quarter of --max-sessions in evaluation mode, "
        "all of them in training mode)",
    )
    parser.add_argument("--max-message-bytes", type=int, help="largest accepted message (default 65536)")
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument(
        "--secret-salt-file",
        type=Path,
        metavar="PATH",
        help="file holding the evaluation secret (or set CERNENV_SECRET_SALT); in evaluation mode without "
        "one, a secret is generated on first use in the state directory",
    )
    secret.add_argument(
        "--ephemeral-secret",
        action="store_true",
        help="a fresh evaluation secret made in memory for this process only, never written or printed "
        "(its fingerprint is): for a scored run of an agent that runs on this machine",
    )
    secret.add_argument(
        "--no-secret",
        action="store_true",
        help="no evaluation secret: the hidden worlds are the public code's (replayable by seed in training mode)",
    )
    parser.add_argument(
        "--results-ledger",
        type=Path,
        metavar="PATH",
        help="where ended episodes' grades are appended, one JSON line each (or set CERNENV_RESULTS_LEDGER; "
        "default in evaluation mode: results.jsonl in the state directory); with --scored-run, the run's "
        "own file, which must not exist yet, or a folder for RUN_ID.jsonl (default: runs/ in the state directory)",
    )
    parser.add_argument(
        "--ledger-max-mib",
        type=float,
        help="rotate the results ledger at this size, which is also each client address's share of it "
        "(default 256; 8 rotated files are kept; a scored run's ledger is never rotated)",
    )
    parser.add_argument(
        "--scored-run",
        metavar="SELECTION",
        help=f"open a scored run at start (or set CERNENV_SCORED_RUN): {SELECTION_HELP}; every reset then "
        "gets the run's next task, each played once, abandoned ones counted as failures "
        "(score it with python -m lib.measure.scorecard LEDGER)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="file holding a bearer token (or set CERNENV_TOKEN): then every route but /health "
        "needs 'Authorization: Bearer <token>'; required to bind beyond 127.0.0.1 safely",
    )
    parser.add_argument(
        "--session-idle-timeout-s",
        type=float,
        help="close a session that has not reset or stepped for this long (default 300)",
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
    parser.add_argument(
        "--trusted-proxy",
        action="append",
        metavar="ADDRESS",
        help="a reverse proxy whose X-Forwarded-For names the client (repeatable; or CERNENV_TRUSTED_PROXIES, "
        "comma-separated); without it the header is ignored and every limit keys on the peer address",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        metavar="ORIGIN",
        help="an origin (https://host[:port]) whose browser pages may use the server (repeatable; or "
        "CERNENV_ALLOWED_ORIGINS); requests from pages of any other origin are refused",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name clients use for this server besides its loopback names and bound address "
        "(repeatable; or CERNENV_ALLOWED_HOSTS, comma-separated; '*' for any): a request naming another "
        "host is refused, so a web page cannot reach the server by rebinding its own name (DNS rebinding)",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return parser


def configure(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from the flags, the variables and the defaults, its secret and
    ledger resolved (a secret generated in the state directory if evaluation mode has none)."""
    try:
        config = ServerConfig.from_env(
            host=args.host,
            port=args.port,
            mode=args.mode,
            max_sessions=args.max_sessions,
            max_sessions_per_client=args.max_sessions_per_client,
            max_message_bytes=args.max_message_bytes,
            secret_salt=_read_secret(parser, args.secret_salt_file, "--secret-salt-file"),
            results_ledger=None if args.results_ledger is None else str(args.results_ledger),
            token=_read_secret(parser, args.token_file, "--token-file"),
            session_idle_timeout_s=args.session_idle_timeout_s,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            request_read_timeout_s=args.request_read_timeout_s,
            trusted_proxies=None if args.trusted_proxy is None else ",".join(args.trusted_proxy),
            allowed_origins=None if args.allowed_origin is None else ",".join(args.allowed_origin),
            scored_run=args.scored_run,
            ledger_max_mib=args.ledger_max_mib,
            allowed_hosts=None if args.allowed_host is None else ",".join(args.allowed_host),
        )
    except ValueError as error:
        parser.error(str(error))
    if args.no_secret:
        config = dataclasses.replace(config, secret_salt="")
    elif args.ephemeral_secret:
        config = dataclasses.replace(config, secret_salt=secrets.token_urlsafe(32))
    elif not config.secret_salt and config.evaluation:
        path = secret_path(state_dir())
        try:
            config = dataclasses.replace(config, secret_salt=generated_secret(path))
        except (OSError, ValueError) as error:
            parser.error(f"cannot use or make the evaluation secret {path}: {error}; give one with --secret-salt-file")
    if not config.results_ledger and config.evaluation:
        try:  # a scored run's ledger is a file of its own, runs/RUN_ID.jsonl
            state = private_dir(state_dir())
            default = private_dir(state / RUNS_DIR) if config.scored_run else ledger_path(state)
            config = dataclasses.replace(config, results_ledger=str(default))
        except OSError as error:
            parser.error(f"cannot keep the results ledger in the state directory: {error}")
    if config.scored_run:
        try:
            selected_tasks(config.scored_run)
        except ValueError as error:
            parser.error(f"--scored-run: {error}")
    return config


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config = configure(parser, args)
    if not config.token and config.host not in LOOPBACK_HOSTS:
        print(
            f"WARNING: serving {config.host} without a token: anyone who can reach this port can open sessions "
            "and use its CPU; set --token-file or CERNENV_TOKEN",
            file=sys.stderr,
            flush=True,
        )
    if config.scored_run:  # the run's own ledger and secret: its line below names them
        grading = "evaluation mode: a scored run, grades withheld and recorded in the run's own ledger"
    elif config.evaluation:
        grading = f"evaluation mode: fresh hidden worlds, grades withheld and recorded in {config.results_ledger}; " + (
            f"evaluation secret {config.secret_fingerprint}" if config.secret_salt else "no evaluation secret"
        )
    else:
        grading = "training mode: rewards served, worlds replayable by seed (not for scoring outsiders)" + (
            f"; evaluation secret {config.secret_fingerprint}" if config.secret_salt else ""
        )
    print(
        f"CERNenv server on http://{config.host}:{config.port} (WebSocket /ws, MCP POST /mcp; at most "
        f"{config.max_sessions} sessions, {config.sessions_per_client} per address; messages up to "
        f"{config.max_message_bytes} bytes{'; bearer token required' if config.token else ''}); {grading}",
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
    guard = ConnectionGuard(
        config.max_connections,
        config.max_connections_per_client,
        config.request_read_timeout_s,
        trusted_proxies=config.proxies,
    )
    events.status = lambda: f"connections open: {guard.open}"
    try:  # a taken port: say which, and how to choose another (uvicorn only logs "[Errno 98]")
        listener = listening_socket(guard, config.host, config.port)
    except OSError as error:
        parser.error(
            f"cannot listen on {config.host}:{config.port} ({error.strerror}): another server may hold "
            f'that port; pick another with --port N (or CERNENV_PORT; `make serve SERVE_ARGS="--port N"`)'
        )
    try:
        app = create_cernenv_app(config)
    except OSError as error:  # the ledger's directory cannot be made or written, or another server holds it
        parser.error(f"cannot open the results ledger {config.results_ledger}: {error}")
    run = app.state.cernenv_run
    if run is not None:
        print(
            f"scored run {run.run_id} open: {len(run.tasks)} tasks ({run.selection}), each reset gets the next once "
            f"the entrant sent its nonce (POST /evaluation/nonce); the operator's secret {run.secret_fingerprint}; "
            f"commitment {run.commitment} (served by GET /evaluation: publish it before play); its lines signed by "
            f"key {run.public_key}; its ledger {run.ledger_path}; score it with: python -m lib.measure.scorecard "
            f"{run.ledger_path}"
            + (
                "; a development run: its worlds are public and the same in every run, to compare agents on, not to "
                "score them"
                if is_development(run.selection)
                else ""
            ),
            flush=True,
        )
    server = guarded_server(app, guard, config.host, config.port, config.ws_frame_limit_bytes, args.log_level)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again at the handler it found: a handler
    # that does nothing, so that a server stopped as asked (its run ended, its ledger closed) exits 0, not 143
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
