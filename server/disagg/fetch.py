"""The decode side of the bootstrap protocol: one :class:`Fetch` per request connects to the prefill instance's
bootstrap server (:mod:`.bootstrap`), sends its room and KV layout, and waits there for the prefill to finish; the
answer (where the KV blocks are, the first token) goes to the engine's ``ready`` queue. Once the engine's worker
has pulled the blocks, :meth:`Fetch.finish` tells the prefill side, which frees them."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading

from .layout import KVLayout
from .wire import Connection

CONNECT_TIMEOUT_S = 5.0


class Fetch:
    """Fetch the KV location of bootstrap ``room`` from the prefill instance at ``host:port``, in a thread.

    Posts ``(request_id, info)`` (the prefill side's ``ready`` answer) or ``(request_id, error)`` (a string naming
    the prefill instance) to ``ready`` and sets ``wakeup``. ``timeout_s`` bounds the wait for the prefill."""

    def __init__(
        self,
        request_id: str,
        host: str,
        port: int,
        room: str,
        layout: KVLayout,
        decode_name: str,
        prompt_ids: list[int],
        timeout_s: float,
        ready: queue.SimpleQueue,
        wakeup: threading.Event,
    ) -> None:
        self.request_id, self.room = request_id, room
        self.source = f"prefill instance {host}:{port}"
        self._ready, self._wakeup = ready, wakeup
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        args = (
            host,
            port,
            {"room": room, "layout": layout.to_json(), "decode": decode_name, "prompt_ids": prompt_ids},
            timeout_s,
        )
        threading.Thread(target=self._run, args=args, name=f"kv-fetch-{room}", daemon=True).start()

    def _post(self, what: dict | str) -> None:
        if not self._cancelled:
            self._ready.put((self.request_id, what))
            self._wakeup.set()

    def _run(self, host: str, port: int, hello: dict, timeout_s: float) -> None:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            self._post(f"cannot reach {self.source} (bootstrap port) for room {self.room}: {e}")
            return
        with self._lock:
            if self._cancelled:
                sock.close()
                return
            self._conn = conn = Connection(sock)
        try:
            conn.send(hello)
            answer = conn.recv(timeout_s + CONNECT_TIMEOUT_S)
        except TimeoutError:
            self._post(f"{self.source} did not answer for room {self.room} within {timeout_s:g}s")
            return
        except (OSError, ValueError) as e:
            answer, why = None, str(e)
        else:
            why = "it closed the connection (did it die?)"
        if answer is None:
            self._post(f"{self.source} failed before handing over the KV cache of room {self.room}: {why}")
        elif "error" in answer:
            self._post(str(answer["error"]))
        else:
            self._post(dict(answer["ready"], source=self.source))

    def finish(self, tokens: int, num_bytes: int) -> None:
        """The KV is in: tell the prefill side (it frees the blocks) and close."""
        with self._lock:
            conn, self._conn, self._cancelled = self._conn, None, True
        if conn is not None:
            with contextlib.suppress(OSError):  # the prefill side is gone: nothing left to free there
                conn.send({"done": {"tokens": tokens, "bytes": num_bytes}})
            conn.close()

    def cancel(self) -> None:
        """Give up (the request was aborted or failed): close the connection; the prefill side frees the blocks."""
        with self._lock:
            conn, self._conn, self._cancelled = self._conn, None, True
        if conn is not None:
            conn.close()
