"""``python -m server.router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...] --port N``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn

from .app import create_router_app
from .pool import POLICIES, Pool


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.router",
        description="OpenAI-compatible router in front "
        "of prefill and decode instances (--disaggregation-mode prefill / decode).",
    )
    parser.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill instance")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode instance")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--policy", choices=POLICIES, default="round-robin", help="how instances are picked")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the instances")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)-9s %(message)s")
    app = create_router_app(
        Pool("prefill", args.prefill, args.policy),
        Pool("decode", args.decode, args.policy),
        args.startup_timeout,
        args.request_timeout,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
