"""The engine thread: the only caller of an :class:`~server.engine_api.EngineCore` (the contract: not thread-safe).

It applies queued commands (add / abort) between steps, so new requests join the running batch at the next step
(continuous batching), then steps while any request is unfinished and hands each step's deltas to the asyncio
loop in one callback (:class:`~server.async_engine.AsyncEngine` is that side).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from server.engine_api import EngineCore, KVTransferParams, RequestDelta, SamplingParams, StepStats

HEALTH_POLL_S = 1.0
"""How often the engine thread asks the engine whether its workers are alive."""
logger = logging.getLogger("server.engine")


def first_line(e: BaseException) -> str:
    """A client-safe summary of an engine failure (the full traceback goes to the log only)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


class EngineDeadError(RuntimeError):
    """The engine has failed or was shut down; requests cannot be served (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Add:
    """A command for the engine thread: add a request (``transfer``: its bootstrap room, disaggregation), then resolve
    ``accepted`` (None, or the engine's error)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    accepted: asyncio.Future[None]
    transfer: KVTransferParams | None = None


@dataclasses.dataclass(frozen=True)
class Abort:
    """A command for the engine thread: abort a request (a no-op if the engine does not have it)."""

    request_id: str


Command = Add | Abort
Deliver = Callable[[list[RequestDelta], float, float, StepStats], None]
"""The asyncio side's handler of a step: its deltas, when it started and ended (``time.monotonic()``), its stats."""


class EngineThread:
    """Runs ``engine`` on a thread of its own; results go to ``loop`` through ``deliver`` (each step) and
    ``fail_all`` (the engine failed: every open stream gets the error)."""

    def __init__(
        self,
        engine: EngineCore,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        fail_all: Callable[[BaseException], None],
    ) -> None:
        self.engine, self.loop, self.deliver, self.fail_all = engine, loop, deliver, fail_all
        self.error: BaseException | None = None
        self.healthy = True
        self.unhealthy_why = "stopped or unhealthy"
        self._commands: list[Command] = []
        self._cond = threading.Condition()
        self._stop = False
        self._closed = False  # set when the thread exits; commands are then rejected
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and self.healthy and not self._stop

    def why_down(self) -> str:
        return first_line(self.error) if self.error is not None else self.unhealthy_why

    def stop(self) -> None:
        """Stop the thread (after the step in progress) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def submit(self, command: Command) -> None:
        with self._cond:
            if not self._closed:
                self._commands.append(command)
                self._cond.notify()
                return
        self._reject(command)

    def _reject(self, command: Command) -> None:
        """Answer a command the thread will never apply (it has exited): an add fails with 503."""
        if isinstance(command, Add):
            why = first_line(self.error) if self.error is not None else "the engine was shut down"
            dead = EngineDeadError(f"the engine is not running ({why})")
            self.loop.call_soon_threadsafe(resolve, command.accepted, dead)

    def _run(self) -> None:
        try:
            self._loop_engine()
        finally:
            with self._cond:
                self._closed = True
                leftover, self._commands = self._commands, []
            for command in leftover:
                self._reject(command)

    def _loop_engine(self) -> None:
        engine = self.engine
        last_health = time.monotonic()
        while True:
            with self._cond:
                while not self._stop and not self._commands and not engine.has_unfinished_requests():
                    if not self._cond.wait(timeout=HEALTH_POLL_S):
                        break
                if self._stop:
                    return
                commands, self._commands = self._commands, []
            try:
                for command in commands:
                    self._apply(command)
                now = time.monotonic()
                if now - last_health >= HEALTH_POLL_S:
                    self.healthy, last_health = engine.is_healthy(), now
                    if not self.healthy:
                        self.unhealthy_why = engine.failure() or self.unhealthy_why
                if not engine.has_unfinished_requests():
                    continue
                start = time.monotonic()
                deltas = engine.step()
                stats = engine.last_step_stats()
                end = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - the engine is dead; every stream gets the error
                self.error = e
                logger.error("the engine failed; serving 503 from now on", exc_info=e)
                self.loop.call_soon_threadsafe(self.fail_all, EngineDeadError(f"engine failed: {first_line(e)}"))
                return
            self.loop.call_soon_threadsafe(self.deliver, deltas, start, end, stats)

    def _apply(self, command: Command) -> None:
        if isinstance(command, Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            if command.transfer is None:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            else:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params, command.transfer)
        except (ValueError, TypeError) as e:
            self.loop.call_soon_threadsafe(resolve, command.accepted, e)
        else:
            self.loop.call_soon_threadsafe(resolve, command.accepted, None)


def resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Settle ``future`` (None: accepted; else the error), unless its waiter was cancelled."""
    if future.done():  # the waiting caller was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
