"""The bootstrap protocol's framing: one JSON object per line over a TCP connection (decode side -> prefill side:
``{"room", "layout", "decode", "prompt_ids"}`` then ``{"done": {"tokens", "bytes"}}``; prefill side -> decode
side: ``{"ready": {...}}`` or ``{"error": why}``)."""

from __future__ import annotations

import contextlib
import json
import socket


class Connection:
    """A line-framed JSON connection over ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def recv(self, timeout: float | None) -> dict | None:
        """The next message; None when the peer closed the connection (or reset it); ``TimeoutError`` after
        ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            line = self._reader.readline()
        except TimeoutError:
            raise
        except OSError:
            return None
        if not line:
            return None
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError(f"bootstrap protocol: expected a JSON object per line, got {line[:80]!r}")
        return message

    def close(self) -> None:
        """Shut the connection down (a thread blocked in :meth:`recv` on it returns) and close it."""
        with contextlib.suppress(OSError):  # not connected any more
            self.sock.shutdown(socket.SHUT_RDWR)
        self._reader.close()
        self.sock.close()
