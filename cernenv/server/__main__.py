"""`python -m cernenv.server [--host H] [--port P] [--max-sessions N] [--max-message-bytes B] ...`.

Each flag overrides its CERNENV_* variable (CERNENV_HOST, CERNENV_PORT, ...), which
overrides the default in `ServerConfig` (127.0.0.1:8000, 64 sessions, 64 KiB messages).
"""

from __future__ import annotations

import argparse
import sys
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
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    args = parser.parse_args(argv)
    try:
        config = ServerConfig.from_env(host=args.host, port=args.port, max_sessions=args.max_sessions,
                                       max_message_bytes=args.max_message_bytes)
    except ValueError as error:
        parser.error(str(error))
    print(f"CERNenv server on http://{config.host}:{config.port} (WebSocket /ws, at most {config.max_sessions} "
          f"sessions, messages up to {config.max_message_bytes} bytes)", file=sys.stderr, flush=True)
    uvicorn.run(create_cernenv_app(config), host=config.host, port=config.port, log_level=args.log_level,
                ws_max_size=config.ws_frame_limit_bytes, ws_per_message_deflate=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
