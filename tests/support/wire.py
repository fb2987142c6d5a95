"""The TCP fault proxy of the tests and the chaos suite: faults on the wire, in the middle of
real traffic, between the gateway and Redis or between the gateway and a downstream.

Two ways to place a fault, both one shot, both matching a chunk of the gateway's request bytes
(a substring: a script's SHA, a job id, a payload marker, ``POST /``).

An *armed* :class:`Fault` (:meth:`WireProxy.arm`, with an expiry; what the chaos runs use) hits
the next request chunk that contains its ``match``:

``drop_after_request``  the request is forwarded, the other side acts; its reply is lost and
                        both connections are aborted (the gateway sees a connection error)
``hold_reply``          the request is forwarded; the reply is held ``hold`` s, then delivered
                        or dropped (``then``)
``hold_request``        the request is held ``hold`` s, then forwarded (even when the gateway
                        gave up on it meanwhile: a stalled Redis runs it late) or dropped
``reset``               both connections are aborted, the request is never forwarded

Besides: ``refuse_for(s)`` closes the listener (connection refused) for a while, and the
legacy whole-proxy modes ``delay``, ``blackhole`` and ``reset`` (new connections closed).
With ``log_http`` the proxy logs every HTTP request that passes the gateway's side of it:
(arrival time, path, Idempotency-Key, Fencing-Token) — the gateway's send time.

A :class:`Rule` (:meth:`WireProxy.on_reply_to`, no expiry, ``skip`` lets that many matching
requests pass first; what a named test uses) acts on the reply chunk that follows the matching
request on that connection, and sets ``fired`` when it does:

``lose``            that reply is dropped and both connections are aborted: the script ran, its
                    reply never arrives; the client's retry policy sends it again on a new
                    connection
``hold``            that reply (and everything after it on that connection) is delivered only
                    after ``seconds``: with ``seconds`` above the client's timeout, the script
                    ran and the caller timed out
``lose_and_refuse`` like ``lose``, then every open connection is aborted and every new one is
                    accepted and aborted for ``seconds``
``blackhole``       that reply and every later one, on every connection (new connections'
                    handshakes included), is held until :meth:`WireProxy.heal`; requests still
                    pass, so what they ask Redis to do runs
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.store.embedded import free_port

__all__ = ["WIRE_MODES", "Fault", "Rule", "Send", "WireProxy"]

WIRE_MODES = ("drop_after_request", "hold_reply", "hold_request", "reset")
RULE_ACTIONS = ("lose", "hold", "lose_and_refuse", "blackhole")

_POST = re.compile(rb"POST /(\w+) HTTP/1\.1\r\n(.*?)\r\n\r\n", re.S)
_HEADER = re.compile(rb"^([A-Za-z-]+): *(.*?)\s*$", re.M)


@dataclass
class Fault:
    mode: str  # one of WIRE_MODES
    match: bytes
    label: str = ""
    hold: float = 0.0
    then: str = "deliver"  # deliver | drop (hold_reply, hold_request)
    expires: float = 0.0
    hit_at: float = 0.0


@dataclass
class Rule:
    match: bytes
    action: str  # one of RULE_ACTIONS
    seconds: float = 0.0
    skip: int = 0  # let this many matching requests pass first
    fired: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Send:
    at: float
    path: str
    key: str
    token: int


class _Conn:
    __slots__ = ("client", "reply_fault", "reply_rules", "up")

    def __init__(self, client: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.client, self.up = client, up
        self.reply_fault: Fault | None = None
        self.reply_rules: list[Rule] = []  # matched by a request, acting on the next replies

    def abort(self) -> None:
        for w in (self.client, self.up):
            with contextlib.suppress(Exception):
                w.transport.abort()


class WireProxy:
    def __init__(self, target_port: int, *, log_http: bool = False) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.log_http = log_http
        self.mode = "pass"  # legacy whole-proxy mode: pass | delay | blackhole | reset
        self.delay = 0.05
        self.armed: list[Fault] = []
        self.hits: list[Fault] = []
        self.sends: list[Send] = []
        self.held = 0  # requests or replies being held right now
        self.refusals = 0  # closed-listener episodes
        self.rules: list[Rule] = []
        self.replies_held = False  # a blackhole rule fired: every reply waits for heal()
        self.refuse_until = 0.0  # lose_and_refuse: new connections aborted until then
        self._healed = asyncio.Event()
        self._conns: set[_Conn] = set()
        self._accepted: set[asyncio.StreamWriter] = set()  # from accept until its pipes end
        self._closed = False
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def start(self) -> WireProxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)
        return self

    def close(self) -> None:
        """Stop listening and abort every connection, those still dialling the target too:
        none outlives the proxy (an unclosed transport fails the test that owns it)."""
        self._closed = True
        self.heal()
        if self._server is not None:
            self._server.close()
        self.reset_all()
        for w in list(self._accepted):
            w.transport.abort()
        self._accepted.clear()

    # -- faults ---------------------------------------------------------------

    def arm(self, fault: Fault, within: float = 1.0) -> None:
        fault.expires = time.monotonic() + within
        self.armed.append(fault)

    def disarm(self) -> None:
        self.armed.clear()

    def on_reply_to(
        self, match: bytes, action: str, seconds: float = 0.0, *, skip: int = 0
    ) -> Rule:
        assert action in RULE_ACTIONS, action
        rule = Rule(match, action, seconds, skip)
        self.rules.append(rule)
        return rule

    def heal(self) -> None:
        """Deliver the replies a ``blackhole`` rule holds, and every later one."""
        self.replies_held = False
        self._healed.set()

    def _match_rule(self, data: bytes) -> Rule | None:
        rule = next((r for r in self.rules if r.match in data), None)
        if rule is None:
            return None
        if rule.skip:
            rule.skip -= 1
            return None
        self.rules.remove(rule)
        return rule

    def reset_all(self) -> None:
        for c in list(self._conns):
            c.abort()
        self._conns.clear()

    async def refuse_for(self, seconds: float) -> None:
        """Connection refused for a while: the listener is closed, open connections aborted."""
        assert self._server is not None
        self._server.close()
        self.reset_all()
        self.refusals += 1
        await asyncio.sleep(seconds)
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    def _take(self, data: bytes) -> Fault | None:
        if not self.armed:
            return None
        now = time.monotonic()
        for f in list(self.armed):
            if f.expires < now:
                self.armed.remove(f)
            elif f.match in data:
                self.armed.remove(f)
                f.hit_at = now
                self.hits.append(f)
                return f
        return None

    def _log(self, data: bytes) -> None:
        now = time.monotonic()
        for m in _POST.finditer(data):
            headers = {k.lower(): v for k, v in _HEADER.findall(m.group(2))}
            key = headers.get(b"idempotency-key", b"").decode()
            token = headers.get(b"fencing-token", b"0")
            self.sends.append(Send(now, m.group(1).decode(), key, int(token or 0)))

    # -- the pipes ------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            writer.close()
            return
        if self._closed or asyncio.get_running_loop().time() < self.refuse_until:
            writer.transport.abort()
            return
        self._accepted.add(writer)
        try:
            await self._pipe(reader, writer)
        finally:
            self._accepted.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        except asyncio.CancelledError:  # the run ended while dialling: the client is dropped
            writer.transport.abort()
            raise
        if self._closed:  # closed while dialling
            writer.transport.abort()
            up_w.transport.abort()
            return
        conn = _Conn(writer, up_w)
        self._conns.add(conn)
        try:
            await asyncio.gather(
                self._requests(conn, reader), self._replies(conn, up_r), return_exceptions=True
            )
        except asyncio.CancelledError:
            conn.abort()  # the run is over (asyncio.run cancels what is left): not an error
        finally:
            self._conns.discard(conn)

    async def _hold(self, seconds: float) -> None:
        self.held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.held -= 1

    async def _requests(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(65536):
                while self.mode == "blackhole":
                    await asyncio.sleep(0.05)
                if self.mode == "delay":
                    await asyncio.sleep(self.delay)
                if self.log_http:
                    self._log(data)
                rule = self._match_rule(data) if self.rules else None
                if rule is not None:
                    conn.reply_rules.append(rule)
                fault = self._take(data)
                if fault is not None:
                    if fault.mode == "reset":
                        conn.abort()
                        return
                    if fault.mode == "hold_request":
                        await self._hold(fault.hold)
                        if fault.then == "drop":
                            conn.abort()
                            return
                    else:  # drop_after_request, hold_reply: the reply pipe acts
                        conn.reply_fault = fault
                conn.up.write(data)
                await conn.up.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            conn.up.close()

    async def _replies(self, conn: _Conn, up_r: asyncio.StreamReader) -> None:
        try:
            while data := await up_r.read(65536):
                fault, conn.reply_fault = conn.reply_fault, None
                if fault is not None:
                    if fault.mode == "drop_after_request":
                        conn.abort()
                        return
                    await self._hold(fault.hold)
                    if fault.then == "drop":
                        conn.abort()
                        return
                while self.mode == "blackhole":
                    await asyncio.sleep(0.05)
                if self.replies_held:
                    await self._healed.wait()
                if conn.reply_rules and not await self._apply_rule(conn, conn.reply_rules.pop(0)):
                    return
                conn.client.write(data)
                await conn.client.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            conn.client.close()

    async def _apply_rule(self, conn: _Conn, rule: Rule) -> bool:
        """Act on the reply chunk a rule matched; False: the reply is lost (connection gone)."""
        rule.fired.set()
        if rule.action == "lose":
            conn.abort()
            return False
        if rule.action == "lose_and_refuse":
            self.refuse_until = asyncio.get_running_loop().time() + rule.seconds
            self.reset_all()
            return False
        if rule.action == "blackhole":  # this reply and every later one, until heal()
            self.replies_held = True
            self._healed.clear()
            await self._healed.wait()
            return True
        await self._hold(rule.seconds)  # hold
        return True

    def hit_counts(self) -> dict[str, Any]:
        out: dict[str, int] = {}
        for f in self.hits:
            name = f.mode if f.mode in ("drop_after_request", "reset") else f"{f.mode}/{f.then}"
            out[name] = out.get(name, 0) + 1
        return dict(sorted(out.items()))
