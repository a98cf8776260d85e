"""What one loopback client that resets again and again, never stepping, writes to an evaluation
server's results ledger.

    python bench/bench_ledger_spam.py [--seconds 20] [--root CHECKOUT]

A server (`python -m cernenv.server`, evaluation mode, its ledger in a temporary folder) and one
WebSocket session from 127.0.0.1 sending `reset` as fast as it is answered, for `--seconds`; the
server is then stopped (its last episode recorded) and the ledger counted: resets answered, lines
and bytes written, per second and as a day's worth at that rate. `--root` runs another checkout's
server (its code, this script), to measure the same client against an older ledger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_server import ROOT, RunningServer, _ws  # beside this script: Python puts its folder on the path


def spam(root: str, seconds: float) -> dict:
    """Resets answered, ledger lines and bytes for one client resetting for `seconds`."""
    with tempfile.TemporaryDirectory(prefix="cernenv-bench-ledger-") as folder:
        ledger = Path(folder) / "results.jsonl"
        server = RunningServer(["--ephemeral-secret", "--results-ledger", str(ledger)], root=root)
        resets = 0
        try:
            with contextlib.ExitStack() as stack:
                ws = _ws(server.url, "127.0.0.1", stack)
                start = time.monotonic()
                while time.monotonic() - start < seconds:
                    ws.send(json.dumps({"type": "reset", "data": {"seed": 902_000 + resets % 50}}))
                    if json.loads(ws.recv(timeout=30)).get("type") != "observation":
                        raise RuntimeError("a reset was refused")
                    resets += 1
                elapsed = time.monotonic() - start
        finally:
            server.stop()
        files = [p for p in Path(folder).glob("results.jsonl*") if not p.name.endswith(".lock")]
        lines = sum(p.read_bytes().count(b"\n") for p in files)
        size = sum(p.stat().st_size for p in files)
    return {"resets": resets, "seconds": elapsed, "lines": lines, "bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--root", default=ROOT, help="the checkout whose server to run (default: this one)")
    args = parser.parse_args()
    result = spam(args.root, args.seconds)
    per_s = {k: result[k] / result["seconds"] for k in ("resets", "lines", "bytes")}
    print(
        f"{args.root}: {result['resets']} resets in {result['seconds']:.1f} s ({per_s['resets']:.0f}/s); ledger "
        f"{result['lines']} lines, {result['bytes']} bytes ({per_s['lines']:.1f} lines/s, {per_s['bytes'] / 1e3:.1f} "
        f"kB/s, {per_s['bytes'] * 86400 / 1e9:.2f} GB a day at that rate); load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
