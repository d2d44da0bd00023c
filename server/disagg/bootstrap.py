"""The prefill side's bootstrap server (``--disaggregation-bootstrap-port``): where decode instances learn where a
request's KV blocks are, and tell when they have pulled them.

The engine :meth:`~BootstrapServer.park` s a request's blocks under its bootstrap room once its first token is
sampled (or :meth:`~BootstrapServer.fail` s the room). A decode instance connects once per request and sends its
room and KV layout (a mismatch is refused naming both sides); the server answers when the room is parked, then
holds the blocks until the decode side says ``done`` or its connection closes (a decode instance that dies frees
them at once). A room nobody claims within ``timeout_s`` is released too. Released rooms are handed back to the
engine (:meth:`~BootstrapServer.take_released`), which frees the blocks on its own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import socketserver
import threading
import time

from .layout import KVLayout, LayoutMismatch
from .wire import Connection

logger = logging.getLogger("server.disagg")


@dataclasses.dataclass
class Released:
    """A room whose blocks the engine may free: the tokens / bytes the decode side reported pulled, the seconds
    from answering it to its ``done`` (0 if none came), and why it ended (``"done"``, or what went wrong)."""

    room: str
    tokens: int
    num_bytes: int
    seconds: float
    why: str


@dataclasses.dataclass
class _Room:
    info: dict | None  # what the decode side needs (None: failed)
    error: str | None
    deadline: float
    claimed: bool = False


class BootstrapServer:
    """A threaded TCP server on ``host:port`` (0: any free port, see :attr:`port`) serving ``layout``'s KV."""

    def __init__(self, host: str, port: int, layout: KVLayout, timeout_s: float) -> None:
        self.layout, self.timeout_s, self.host = layout, timeout_s, host
        self._rooms: dict[str, _Room] = {}
        self._released: list[Released] = []
        self._cond = threading.Condition()
        self._closed = False
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(Connection(self.request))

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.name = f"prefill instance {host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, name="kv-bootstrap", daemon=True).start()
        threading.Thread(target=self._reap, name="kv-bootstrap-reaper", daemon=True).start()

    # ---- the engine's side ----
    def park(self, room: str, info: dict) -> None:
        """The request of ``room`` holds its blocks for the decode side (``info``: where they are)."""
        with self._cond:
            self._rooms[room] = _Room(info, None, time.monotonic() + self.timeout_s)
            self._cond.notify_all()

    def fail(self, room: str, why: str) -> None:
        """The request of ``room`` ended without KV to hand over (``why`` goes to the decode side)."""
        with self._cond:
            self._rooms[room] = _Room(None, why, time.monotonic() + self.timeout_s)
            self._cond.notify_all()

    def take_released(self) -> list[Released]:
        with self._cond:
            released, self._released = self._released, []
        return released

    def has_released(self) -> bool:
        return bool(self._released)

    @property
    def num_rooms(self) -> int:
        """Rooms parked or failed and not released yet."""
        return len(self._rooms)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # ---- connection threads ----
    def _release(self, room: str, tokens: int, num_bytes: int, seconds: float, why: str) -> None:
        with self._cond:
            entry = self._rooms.pop(room, None)
            if entry is not None and entry.info is not None:
                self._released.append(Released(room, tokens, num_bytes, seconds, why))

    def _reap(self) -> None:
        """Release rooms nobody claimed within the timeout."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                late = [r for r, e in self._rooms.items() if not e.claimed and e.deadline <= now]
            for room in late:
                logger.warning(
                    "%s: no decode instance pulled bootstrap room %s within %gs; freeing its KV blocks",
                    self.name,
                    room,
                    self.timeout_s,
                )
                self._release(room, 0, 0, 0.0, "timeout")
            time.sleep(min(0.25, self.timeout_s / 4))

    def _serve(self, conn: Connection) -> None:
        room = None
        try:
            hello = conn.recv(self.timeout_s)
            if hello is None:
                return
            room, decode = str(hello["room"]), str(hello.get("decode", "the decode instance"))
            try:
                self.layout.check_matches(KVLayout.from_json(hello["layout"]), self.name, decode)
            except LayoutMismatch as e:
                conn.send({"error": str(e)})
                return
            entry = self._claim(room)
            if entry is None:
                conn.send(
                    {
                        "error": f"{self.name} has no request with bootstrap room {room} after "
                        f"{self.timeout_s:g}s (never sent here, or freed after its timeout)"
                    }
                )
                return
            if entry.info is None:
                conn.send({"error": f"{self.name}: the request of bootstrap room {room} failed: {entry.error}"})
                self._release(room, 0, 0, 0.0, "failed")
                return
            if hello.get("prompt_ids") != entry.info["prompt_ids"]:
                conn.send(
                    {
                        "error": f"{self.name}: bootstrap room {room} holds a different prompt than {decode} "
                        "was sent (both halves of a request must get the same body)"
                    }
                )
                self._release(room, 0, 0, 0.0, "prompt mismatch")
                return
            sent = time.monotonic()
            conn.send({"ready": {k: v for k, v in entry.info.items() if k != "prompt_ids"}})
            done = conn.recv(self.timeout_s)
            seconds = time.monotonic() - sent
            if done is None or "done" not in done:
                self._release(room, 0, 0, 0.0, f"{decode} closed the connection before it finished the transfer")
                return
            self._release(room, int(done["done"]["tokens"]), int(done["done"]["bytes"]), seconds, "done")
            room = None
        except (OSError, ValueError, KeyError, TimeoutError) as e:
            if room is not None:
                self._release(room, 0, 0, 0.0, f"bootstrap connection failed: {e}")
        finally:
            conn.close()

    def _claim(self, room: str) -> _Room | None:
        """Wait (up to the timeout) for ``room`` to be parked or failed, and claim it."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while (entry := self._rooms.get(room)) is None or entry.claimed:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            entry.claimed = True
            return entry
