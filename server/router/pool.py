"""The router's instances: one :class:`Pool` of prefill instances and one of decode instances, each picking an
instance per request (``round-robin`` or ``least-loaded``: the fewest requests in flight through this router). An
instance that fails a request at the connection level is marked down and skipped until its ``/health`` answers 200
again (:meth:`Pool.probe`, every second)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import httpx

POLICIES = ("round-robin", "least-loaded")
logger = logging.getLogger("server.router")


class NoInstance(RuntimeError):
    """Every instance of a pool is down."""


@dataclasses.dataclass
class Instance:
    """One server; a prefill instance's ``bootstrap_host`` / ``bootstrap_port`` come from its ``/disaggregation``."""

    url: str
    kind: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    inflight: int = 0
    down: str | None = None  # why it is down; None: up


class Pool:
    """The instances of one ``kind`` (``prefill`` / ``decode``), picked by ``policy`` (:data:`POLICIES`)."""

    def __init__(self, kind: str, urls: list[str], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {list(POLICIES)}")
        if not urls:
            raise ValueError(f"--{kind}: give at least one {kind} instance URL")
        self.kind, self.policy = kind, policy
        self.instances = [Instance(url.rstrip("/"), kind) for url in urls]
        self._next = 0

    def pick(self) -> Instance:
        up = [i for i in self.instances if i.down is None]
        if not up:
            why = "; ".join(f"{i.url}: {i.down}" for i in self.instances)
            raise NoInstance(f"no {self.kind} instance is up ({why})")
        if self.policy == "least-loaded":
            return min(up, key=lambda i: i.inflight)
        self._next += 1
        return up[(self._next - 1) % len(up)]

    def mark_down(self, instance: Instance, why: str) -> None:
        if instance.down is None:
            logger.warning(
                "%s instance %s is down (%s); routing to the others until its /health answers",
                self.kind,
                instance.url,
                why,
            )
        instance.down = why

    async def connect(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for every instance's ``/disaggregation`` and check its mode is this pool's
        kind; a prefill instance's answer gives its bootstrap address. ``ValueError`` for a wrong mode or one that
        never answers."""
        deadline = time.monotonic() + timeout_s
        for instance in self.instances:
            while True:
                try:
                    r = await client.get(instance.url + "/disaggregation", timeout=5.0)
                    info = r.json() if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError) as e:
                    info, why = None, repr(e)
                else:
                    why = f"HTTP {r.status_code}"
                if info is not None:
                    break
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"--{self.kind} {instance.url}: no answer from /disaggregation within {timeout_s:g}s ({why})"
                    )
                await asyncio.sleep(0.5)
            if info.get("mode") != self.kind:
                raise ValueError(
                    f"--{self.kind} {instance.url}: that server runs with --disaggregation-mode "
                    f"{info.get('mode')}, not {self.kind}"
                )
            instance.bootstrap_host, instance.bootstrap_port = info.get("bootstrap_host"), info.get("bootstrap_port")

    async def check(self, client: httpx.AsyncClient, instance: Instance) -> None:
        """Mark ``instance`` down now if its ``/health`` cannot be reached (a request it took part in failed on the
        other side, e.g. the decode instance could not pull its KV: the next request must not be routed to a dead
        instance before the prober notices)."""
        try:
            await client.get(instance.url + "/health", timeout=2.0)
        except httpx.HTTPError as e:
            self.mark_down(instance, repr(e))

    async def probe(self, client: httpx.AsyncClient) -> None:
        """Bring back the down instances whose ``/health`` answers 200."""
        for instance in self.instances:
            if instance.down is None:
                continue
            try:
                ok = (await client.get(instance.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                logger.info("%s instance %s is up again", self.kind, instance.url)
                instance.down = None
