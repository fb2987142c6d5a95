"""Auto-pipelining: the Redis commands issued in one event-loop tick go out in one write.

Under load, many requests reach their admit (or record) in the same tick of
the event loop. Sent one by one, each pays a connection checkout, a
``send()`` system call and a wake-up of Redis; the profile of the gateway was
dominated by exactly that. :class:`Batcher` queues the commands of a tick and
flushes them at the end of it: one connection, one ``writelines``, then the
replies are read in order and handed to each caller's future. Nothing is
delayed by a timer, so a lone request goes out in the same tick it was issued
(same latency as a direct call).

Semantics are those of one command at a time, per command:

* each command gets its own reply or its own error (``ResponseError``);
* ``NOSCRIPT`` (script cache flushed, Redis restarted) re-sends that command
  as ``EVAL`` with the full source, which also loads it again;
* a connection error before a reply arrived re-sends the commands that have
  no reply yet, under the connection's own :class:`~redis.asyncio.retry.Retry`
  policy, exactly as redis-py does for a single command (the deciding scripts
  are safe to re-run: each remembers its reply per request id); a command
  marked ``resend=False`` (the audit feed's ``XADD *``) fails instead, since it
  may have run;
* a timeout (``redis.timeout_seconds`` for the whole exchange) or any other
  failure fails every command still without a reply and drops the connection
  (its state is unknown), never re-sending;
* a caller that gives up (its request was cancelled) does not disturb the
  batch: its reply is read and dropped, so the connection stays in step;
* a command marked ``asking`` (Cluster: the slot is being imported here, see
  :mod:`gateway.store.router`) goes out right after an ``ASKING`` on the same
  connection, every time it is sent (a re-send, its ``EVAL``);
* with ``[redis] replicas_acked = R`` (an :class:`~gateway.store.replication.AckPolicy`), the
  batch ends with a covering write, ``WAIT`` and ``WAITAOF`` in the same write on the same
  connection, and no reply is handed out before they say the primary and R replicas
  fsynced it; otherwise every command of the batch fails with
  :class:`~gateway.store.replication.NotReplicated` (see :mod:`gateway.store.replication`).

The batch runs in its own task, so cancelling a request never cuts a
connection in the middle of a pipelined exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.store.replication import AckPolicy, AckStatus, first_key

__all__ = ["Batcher", "NotSent"]

# Cluster answers that mean the command did not run on that node (MovedError is an AskError)
_NOT_RUN = (AskError, TryAgainError, ClusterDownError)


class NotSent(RedisConnectionError):
    """No connection could be had: the commands were never written, so they did not run."""


# One batch per connection write; more pending commands than this open
# another batch on another pooled connection in the same tick.
MAX_BATCH = 256


class _Call:
    __slots__ = ("answered", "args", "asking", "future", "reply", "resend", "sent", "source")

    def __init__(self, args: tuple[Any, ...], source: str | None, future: asyncio.Future[Any]):
        self.args = args
        self.source = source  # the script's source when args is an EVALSHA
        self.future = future
        self.answered = False  # a reply (or error reply) was read for it
        self.reply: Any = None  # handed out once the batch is acknowledged (replicas_acked)
        self.sent = False  # written to a connection at least once
        # safe to send again when a dropped connection lost its reply: the scripts are (they
        # remember their reply per request id); a raw XADD with an automatic id is not
        self.resend = True
        self.asking = False  # Cluster: preceded by ASKING (the slot is importing here)


class Batcher:
    """Queues commands per event-loop tick and sends each tick's queue as one pipeline."""

    def __init__(self, client: aioredis.Redis, ack: AckPolicy | None = None) -> None:
        # Its own pool, like the client's but without a per-socket-operation timeout:
        # redis-py implements that with a wait_for (a task) per send and a timer per
        # reply; the batcher bounds the whole exchange with one timeout instead.
        source = client.connection_pool
        self._timeout = source.connection_kwargs.get("socket_timeout") or 5.0
        self._pool = aioredis.BlockingConnectionPool(
            connection_class=source.connection_class,
            max_connections=source.max_connections,
            timeout=self._timeout,
            **{**source.connection_kwargs, "socket_timeout": None},
        )
        self._pending: list[_Call] = []
        # the loop of the first call; asyncio.get_running_loop() costs a getpid() system call
        # on Python 3.11, once per command
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # counters for the metrics and the tests
        self.commands = 0
        self.ack = ack  # None: a reply is handed out as soon as it is read (replicas_acked 0)
        # Cluster: a key in a slot this node serves, for the covering write (the router sets it;
        # a batch's first key may be one the node no longer serves, or one it is importing)
        self.cover_key: str | None = None
        host = source.connection_kwargs.get("host") or source.connection_kwargs.get("path", "")
        self.ack_status = AckStatus(node=f"{host}:{source.connection_kwargs.get('port', '')}")

    @property
    def ack_failures(self) -> tuple[int, int] | None:
        """(batches, commands) the replicas did not acknowledge; None: replicas_acked is 0."""
        if self.ack is None:
            return None
        return self.ack_status.failed_batches, self.ack_status.failed_commands

    def evalsha(
        self, sha: str, source: str, keys: Sequence[str], args: Sequence[str]
    ) -> asyncio.Future[Any]:
        """Run a script by SHA (``EVAL`` of ``source`` if Redis does not know it)."""
        return self._enqueue(("EVALSHA", sha, len(keys), *keys, *args), source)

    def execute(self, *args: Any, resend: bool = True) -> asyncio.Future[Any]:
        """Any other command; the reply comes back raw (no redis-py response callback)."""
        future = self._enqueue(args, None)
        if not resend:
            self._pending[-1].resend = False
        return future

    def submit(
        self,
        args: tuple[Any, ...],
        source: str | None,
        *,
        resend: bool = True,
        asking: bool = False,
    ) -> asyncio.Future[Any]:
        """Any command, with the flags the Cluster router sets (``source``: an EVALSHA's)."""
        future = self._enqueue(args, source)
        call = self._pending[-1]
        call.resend = resend
        call.asking = asking
        return future

    def _enqueue(self, args: tuple[Any, ...], source: str | None) -> asyncio.Future[Any]:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(_Call(args, source, future))
        return future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_BATCH):
            assert self._loop is not None
            task = self._loop.create_task(self._run(pending[start : start + MAX_BATCH]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, calls: list[_Call]) -> None:
        self.batches += 1
        self.commands += len(calls)
        try:
            # bounded too: a new connection's handshake to a Redis that stalls never returns
            async with asyncio.timeout(self._timeout):
                conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        except BaseException as exc:
            if isinstance(exc, Exception):  # nothing was written: the commands did not run
                exc = NotSent(f"no connection to Redis within {self._timeout} s: {exc!r}")
            _fail(calls, exc)
            if not isinstance(exc, Exception):
                raise
            return
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    await conn.retry.call_with_retry(
                        lambda: self._exchange(conn, calls),
                        lambda _error: conn.disconnect(nowait=True),
                    )
            except TimeoutError:
                raise RedisTimeoutError(f"no reply from Redis within {self._timeout} s") from None
        except BaseException as exc:
            await conn.disconnect(nowait=True)  # mid-exchange: its state is unknown
            _fail(calls, exc)
            if not isinstance(exc, Exception):
                raise  # cancellation (shutdown) propagates
        finally:
            await self._pool.release(conn)

    async def _exchange(self, conn: Any, calls: list[_Call]) -> None:
        # On a retry (the connection dropped), only what has no reply yet is re-sent.
        todo = []
        for call in calls:
            if call.answered:
                continue
            if call.sent and not call.resend:  # it may have run: fail it, never send it twice
                call.answered = True
                _settle(call, RedisConnectionError("connection lost before the reply"))
                continue
            call.sent = True
            todo.append(call)
        # the acknowledgement's tail goes in the same write (also when everything was answered
        # before a dropped connection: the tail must run again on this one)
        tail = self._tail(calls)
        asking = [c.asking for c in todo] + [False] * len(tail)
        replies = await _roundtrip(conn, [*(c.args for c in todo), *tail], asking)
        acked = replies[len(todo) :]
        missing: list[_Call] = []
        for call, reply in zip(todo, replies, strict=False):
            if isinstance(reply, NoScriptError) and call.source is not None:
                missing.append(call)
            else:
                call.answered = True
                call.reply = reply
        if missing:  # the script cache was flushed: EVAL loads and runs in one go
            resend = [("EVAL", c.source, *c.args[2:]) for c in missing]
            asking = [c.asking for c in missing] + [False] * len(tail)
            replies = await _roundtrip(conn, [*resend, *tail], asking)
            acked = replies[len(missing) :]
            for call, reply in zip(missing, replies, strict=False):
                call.answered = True
                call.reply = reply
        if self.ack is not None:
            reason = self.ack.check(acked)
            self.ack_status.note(not reason, reason, len(calls))
            if reason:  # not one reply of this batch may leave: they all depend on it
                failure = self.ack.failure(reason)
                failure.stale_map = isinstance(acked[0], AskError)  # MOVED or ASK
                for call in calls:
                    # a redirected command did not run (Cluster): its own error, so the router
                    # sends it where it belongs (and reads the map again)
                    redirected = call.answered and isinstance(call.reply, _NOT_RUN)
                    _settle(call, call.reply if redirected else failure)
                return
        for call in calls:
            if call.answered:
                _settle(call, call.reply)

    def _tail(self, calls: list[_Call]) -> list[tuple[Any, ...]]:
        if self.ack is None:
            return []
        if self.cover_key:  # Cluster: a slot this node serves (set by the router)
            return list(self.ack.tail(self.cover_key))
        for call in calls:  # the covering write goes to the slot of a key of this batch
            if not call.asking and (key := first_key(call.args)) is not None:
                return list(self.ack.tail(key))
        return list(self.ack.tail("fg"))

    async def aclose(self) -> None:
        """Wait for the batches in flight, then close the connections (shutdown). A tick's queue
        not flushed yet goes out first, and batches started meanwhile are waited for too: a
        connection opened after the pool was closed would be left open."""
        while self._pending or self._tasks:
            if self._pending:
                self._flush()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._pool.disconnect()


_ASKING = hiredis.pack_command(("ASKING",))


async def _roundtrip(
    conn: Any, commands: list[tuple[Any, ...]], asking: Sequence[bool] = ()
) -> list[Any]:
    """Send commands in one write; read one reply each (an error reply is returned, not raised).
    A command flagged in ``asking`` is preceded by ``ASKING``, whose own reply is dropped.

    Packed by hiredis (C); redis-py's asyncio connection packs in Python, which
    was the largest Redis cost left in the profile once writes were batched.
    """
    if any(asking):
        parts = []
        for command, ask in zip(commands, asking, strict=True):
            if ask:
                parts.append(_ASKING)
            parts.append(hiredis.pack_command(command))
        packed = b"".join(parts)
    else:
        asking = ()
        packed = b"".join([hiredis.pack_command(c) for c in commands])
    await conn.send_packed_command(packed, check_health=False)
    replies: list[Any] = []
    for i in range(len(commands)):
        if asking and asking[i]:
            with contextlib.suppress(ResponseError):  # the command's own reply says what happened
                await conn.read_response()  # +OK of ASKING
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def _settle(call: _Call, reply: Any) -> None:
    if call.future.done():  # the caller gave up; its reply was read, so the stream stays in step
        return
    if isinstance(reply, BaseException):
        call.future.set_exception(reply)
    else:
        call.future.set_result(reply)


def _fail(calls: list[_Call], exc: BaseException) -> None:
    for call in calls:
        if call.future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            call.future.cancel()
        else:
            call.future.set_exception(exc)
