"""`python -m cernenv.server [--host H] [--port P] [--max-sessions N] [--max-message-bytes B] ...`.

Each flag overrides its CERNENV_* variable (CERNENV_HOST, CERNENV_PORT, ...), which
overrides the default in `ServerConfig` (127.0.0.1:8000, 64 sessions, 64 KiB messages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import uvicorn

from cernenv.server.app import ServerConfig, create_cernenv_app


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cernenv.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="TCP port (default 8000)")
    parser.add_argument("--max-sessions", type=int, help="concurrent WebSocket sessions (default 64)")
    parser.add_argument("--max-message-bytes", type=int, help="largest accepted message (default 65536)")
    parser.add_argument("--secret-salt-file", type=Path, metavar="PATH",
                        help="file holding the evaluation secret (or set CERNENV_SECRET_SALT): mixed into the "
                             "hidden particles and data, so the public code cannot look answers up by seed")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    args = parser.parse_args(argv)
    secret = None
    if args.secret_salt_file is not None:
        try:
            secret = args.secret_salt_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"cannot read --secret-salt-file {args.secret_salt_file}: {error}")
        if not secret:
            parser.error(f"--secret-salt-file {args.secret_salt_file} is empty: write the secret in it")
    try:
        config = ServerConfig.from_env(host=args.host, port=args.port, max_sessions=args.max_sessions,
                                       max_message_bytes=args.max_message_bytes, secret_salt=secret)
    except ValueError as error:
        parser.error(str(error))
    print(f"CERNenv server on http://{config.host}:{config.port} (WebSocket /ws, at most {config.max_sessions} "
          f"sessions, messages up to {config.max_message_bytes} bytes"
          f"{', with an evaluation secret' if config.secret_salt else ''})", file=sys.stderr, flush=True)
    uvicorn.run(create_cernenv_app(config), host=config.host, port=config.port, log_level=args.log_level,
                ws_max_size=config.ws_frame_limit_bytes, ws_per_message_deflate=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
