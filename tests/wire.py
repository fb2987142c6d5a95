"""Faults on the wire, in process: a TCP proxy between the gateway and Redis that acts on
the replies it carries back.

A rule matches a chunk of the gateway's request bytes (a substring: a job id, a payload
marker) and then acts, once, on the reply chunk that follows on that connection:

* ``lose``: drops that reply and resets both connections. The script ran; its reply never
  arrives; the client's retry policy sends it again on a new connection.
* ``hold``: forwards that chunk (and everything after it on that connection) only after
  ``seconds``. With ``seconds`` above the client's timeout: the script ran, the caller
  timed out.
* ``lose_and_refuse``: like lose, then refuses every new connection for ``seconds``.
* ``blackhole``: holds that reply and every later one, on every connection (new
  connections' handshakes included), until :meth:`heal`; also :meth:`blackhole` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from gateway.store.embedded import free_port

__all__ = ["Rule", "WireProxy"]


@dataclass
class Rule:
    match: bytes
    action: str  # lose | hold
    seconds: float = 0.0
    skip: int = 0  # let this many matching requests pass first
    fired: asyncio.Event = field(default_factory=asyncio.Event)


class WireProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.rules: list[Rule] = []
        self.blackholed = False
        self.refuse_until = 0.0
        self._healed = asyncio.Event()
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def close(self) -> None:
        self.heal()
        for w in list(self._conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        if self._server is not None:
            self._server.close()

    def on_reply_to(
        self, match: bytes, action: str, seconds: float = 0.0, *, skip: int = 0
    ) -> Rule:
        rule = Rule(match, action, seconds, skip)
        self.rules.append(rule)
        return rule

    def blackhole(self) -> None:
        self.blackholed = True
        self._healed.clear()

    def heal(self) -> None:
        self.blackholed = False
        self._healed.set()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if asyncio.get_running_loop().time() < self.refuse_until:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._conns.update((writer, up_w))

        def reset() -> None:
            for w in (writer, up_w):
                with contextlib.suppress(Exception):
                    w.transport.abort()

        armed: list[Rule] = []

        async def requests() -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(65536):
                    rule = next((r for r in self.rules if r.match in data), None)
                    if rule is not None:
                        if rule.skip:
                            rule.skip -= 1
                        else:
                            self.rules.remove(rule)
                            armed.append(rule)
                    up_w.write(data)
                    await up_w.drain()
            up_w.close()

        async def replies() -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await up_r.read(65536):
                    if self.blackholed:
                        await self._healed.wait()
                    if armed:
                        rule = armed.pop(0)
                        if rule.action == "blackhole":  # this reply and all after it
                            rule.fired.set()
                            self.blackhole()
                            await self._healed.wait()
                        elif rule.action == "lose_and_refuse":
                            rule.fired.set()
                            self.refuse_until = asyncio.get_running_loop().time() + rule.seconds
                            for w in list(self._conns):
                                with contextlib.suppress(Exception):
                                    w.transport.abort()
                            return
                        elif rule.action == "lose":
                            rule.fired.set()
                            reset()
                            return
                        rule.fired.set()
                        await asyncio.sleep(rule.seconds)
                    writer.write(data)
                    await writer.drain()
            writer.close()

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(requests(), replies())
        self._conns.difference_update((writer, up_w))
