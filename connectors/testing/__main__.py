"""``python -m sagaguard.connectors.testing KIND [--host H] [--port P] [--config JSON]``: run a local server.

KIND is ``stripe`` (:mod:`sagaguard.connectors.testing.stripe_server`), ``http`` (an API honouring the
``Idempotency-Key`` header, :mod:`sagaguard.connectors.testing.http_server`) or ``chat`` (OpenAI-compatible
chat completions, :mod:`sagaguard.connectors.testing.chat_server`). Prints one JSON line ``{"url": ...,
"port": ...}`` once it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Mapping
from typing import Any

from sagaguard.connectors.testing._service import App, serve

KINDS = ("stripe", "http", "chat")


def make_app(kind: str, config: Mapping[str, Any]) -> App:
    """The app of the server ``kind``.

    Raises:
        ValueError: unknown kind.
    """
    if kind == "stripe":
        from sagaguard.connectors.testing.stripe_server import StripeApp

        return StripeApp(config)
    if kind == "http":
        from sagaguard.connectors.testing.http_server import IdempotentApiApp

        return IdempotentApiApp(config)
    if kind == "chat":
        from sagaguard.connectors.testing.chat_server import ChatApp

        return ChatApp(config)
    raise ValueError(f"unknown local server {kind!r}; choose one of {KINDS}")


def main(argv: list[str] | None = None) -> int:
    """Run one local server until it is stopped (or its stdin closes, with --exit-on-stdin-eof)."""
    parser = argparse.ArgumentParser(prog="python -m sagaguard.connectors.testing")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--config", default="{}", help="the server's options as JSON")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    app = make_app(args.kind, json.loads(args.config))
    with contextlib.suppress(KeyboardInterrupt):
        serve(app, args.host, args.port, exit_on_stdin_eof=args.exit_on_stdin_eof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
