"""The Cluster router: one auto-pipeline per primary, each command sent to its slot's owner.

With ``[redis] cluster = true`` the store's scripts and pipelined commands go through a
:class:`ClusterRouter` instead of one :class:`~gateway.store.batching.Batcher`. It keeps the
slot map (``CLUSTER SLOTS`` from any reachable node: the seeds, then every node it has seen)
and one ``Batcher`` per primary, so the commands of one event-loop tick still go out as one
write per primary: one round trip per deciding script, as standalone. Every key of a script
shares its job's hash tag (:mod:`gateway.store.keys`), so a script has one slot and one node.

Per command, on the reply of the node it was sent to:

* ``MOVED slot host:port`` — the slot lives elsewhere now (a failover, a finished migration):
  the map entry is corrected, a full refresh is started, the command goes to the new owner.
  A ``MOVED`` reply means the command did not run there.
* ``ASK slot host:port`` — the slot is migrating and this key is already on the target: the
  command goes to the target preceded by ``ASKING`` on the same connection (the batcher's
  ``asking`` flag, kept for its re-sends and its ``EVAL``); the map is not changed.
* ``TRYAGAIN`` — the keys of the command are split between the two nodes of a migrating slot:
  retried after 10, 20, 40 … ms (capped at 200 ms) until the exchange's timeout, then it
  fails (503); nothing ran.
* ``CLUSTERDOWN`` / ``MASTERDOWN`` — fails at once (503); nothing ran. ``READONLY``,
  ``NOREPLICAS``, ``OOM`` pass through to the store, which answers 503 as standalone.
* ``NOSCRIPT`` — handled by the node's batcher (``EVAL`` loads and runs): scripts are per
  node, so a primary promoted by a failover needs one ``EVAL`` per script.
* The node cannot be reached, or the connection dropped before the reply: the map is read
  again from the other nodes; if the slot has a new owner (a failover), the command goes
  there, else it fails (503) — during the ~2 s before a replica is promoted every call on
  that shard answers 503 fast instead of hanging.

Re-sending a script is safe because the prelude remembers each reply under its request id
(the trailer, :mod:`gateway.store.store`): a script that did run on the old owner and reached
its replica answers the remembered reply on the new owner; one whose write was lost in the
failover runs again there, on the new owner's state, and only that reply leaves the gateway.
Each re-send carries the highest value of the slot's counter the gateway has seen *by then*
(not the one of the first send): if the new owner is behind a reply the gateway already
acknowledged — a failover to a replica that lagged — the prelude answers ``{8, 'behind'}``
and the call fails closed instead of deciding on lost state. A command that must not run
twice (``resend=False``: the audit feed's ``XADD *``) is never re-sent after it may have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.store.batching import Batcher, NotSent
from gateway.store.keys import SLOTS, key_slot, slot_tags
from gateway.store.marks import SlotMarks
from gateway.store.replication import AckPolicy, NotReplicated

__all__ = ["ClusterRouter", "NotRun", "key_slot_of", "parse_slots"]

log = structlog.get_logger("fencegate.router")

# The prelude's trailer (gateway/store/lua/_prelude.lua): ARGV[#ARGV - 2] is the highest value
# of the slot's counter the gateway has seen; refreshed on every re-send of a script.
_SEEN_FROM_END = 3
_MAX_REDIRECTS = 8


class NotRun(NotSent):
    """The cluster refused the command before running it (MOVED/ASK loop, TRYAGAIN past the
    bound, CLUSTERDOWN, no node serving the slot): nothing was done."""


_REDIRECTED = (AskError, TryAgainError, ClusterDownError, RedisConnectionError)


def _copy(task: asyncio.Future[Any], outer: asyncio.Future[Any]) -> None:
    if outer.done():
        if not task.cancelled():
            task.exception()
    elif task.cancelled():
        outer.cancel()
    elif (error := task.exception()) is not None:
        outer.set_exception(error)
    else:
        outer.set_result(task.result())


def key_slot_of(key: str) -> int:
    """A key's slot by Redis's hash tag rule: the part between the first ``{`` and the next
    ``}`` when that is not empty, else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key_slot(key[start + 1 : end])
    return key_slot(key)


def parse_slots(reply: Sequence[Any]) -> list[str | None]:
    """``CLUSTER SLOTS`` → the primary (``host:port``) of every slot (None: not served)."""
    owners: list[str | None] = [None] * SLOTS
    for entry in reply:
        first, last, primary = int(entry[0]), int(entry[1]), entry[2]
        host = primary[0] if isinstance(primary[0], str) else primary[0].decode()
        addr = f"{host}:{int(primary[1])}"
        for slot in range(first, last + 1):
            owners[slot] = addr
    return owners


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class ClusterRouter:
    """Routes scripts and commands per slot to one :class:`Batcher` per primary."""

    def __init__(
        self,
        seeds: Sequence[tuple[str, int]],
        connection_kwargs: Mapping[str, Any],
        *,
        max_connections: int,
        slot_seen: SlotMarks | Mapping[int, int] | None = None,
        ack: AckPolicy | None = None,
    ) -> None:
        self._seeds = [f"{host}:{port}" for host, port in seeds]
        self._kwargs = dict(connection_kwargs)
        self._timeout = float(self._kwargs.get("socket_timeout") or 5.0)
        self._max_connections = max_connections
        self._seen = slot_seen if slot_seen is not None else {}
        # replicas_acked: every node's batches end with the acknowledgement's tail
        # (gateway.store.replication), its covering write in a slot that node serves
        self.ack = ack
        self.owners: list[str | None] = [None] * SLOTS
        self._nodes: dict[str, Batcher] = {}
        # per node, without the acknowledgement's tail: the map reads and PINGs (a tail needs
        # a slot the node serves, which the map tells)
        self._plain: dict[str, Batcher] = {}
        self._refresh: asyncio.Task[None] | None = None
        self._refreshed_at = 0.0
        self._closed = False
        # counters for the metrics and the tests
        self.redirects = {"moved": 0, "ask": 0, "tryagain": 0, "failover": 0}
        self._retired_batches = self._retired_commands = 0

    # -- the Batcher interface the store uses ----------------------------------
    @property
    def batches(self) -> int:
        return self._retired_batches + sum(b.batches for b in self._nodes.values())

    @property
    def pipelined_nodes(self) -> tuple[str, ...]:
        """The nodes (``host:port``) this router has sent commands to, each with its own
        pipeline."""
        return tuple(self._nodes)

    @property
    def commands(self) -> int:
        return self._retired_commands + sum(b.commands for b in self._nodes.values())

    @property
    def ack_failures(self) -> tuple[int, int] | None:
        """(batches, commands) the replicas did not acknowledge, all nodes; None: no ack."""
        if self.ack is None:
            return None
        got = [b.ack_failures or (0, 0) for b in self._nodes.values()]
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def evalsha(
        self, sha: str, source: str, keys: Sequence[str], args: Sequence[str]
    ) -> asyncio.Future[Any]:
        """Run a script on its slot's primary (``EVAL`` there if that node lacks it)."""
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        return self._send(key_slot_of(keys[0]), command, source, True)

    def execute(self, *args: Any, resend: bool = True) -> asyncio.Future[Any]:
        """A single-key command (the key is ``args[1]``) on that key's primary."""
        return self._send(key_slot_of(str(args[1])), args, None, resend)

    def execute_on(self, node: str, *args: Any) -> asyncio.Future[Any]:
        """A command for one node itself (``PING``, ``CLUSTER SLOTS``): never acknowledged."""
        return self._node(node, plain=True).submit(args, None)

    async def primaries(self) -> list[str]:
        """The primaries serving slots now (``host:port``), from a fresh map."""
        await self.refresh(force=True)
        return sorted({a for a in self.owners if a is not None})

    async def healthy(self) -> bool:
        """Every slot served (a fresh map) and every primary answers ``PING``."""
        await self.refresh(force=True)
        if None in self.owners:
            return False
        nodes = sorted({a for a in self.owners if a is not None})
        replies = await asyncio.gather(
            *(self.execute_on(n, "PING") for n in nodes), return_exceptions=True
        )
        return all(r in ("PONG", b"PONG", True) for r in replies)

    async def acknowledging(self) -> dict[str, bool]:
        """replicas_acked: per primary, whether a batch there is acknowledged now (a ``PING``
        through its acknowledged batcher: its covering write, ``WAIT``, ``WAITAOF``)."""
        nodes = await self.primaries()
        replies = await asyncio.gather(
            *(self._node(n).submit(("PING",), None) for n in nodes), return_exceptions=True
        )
        return {n: r in ("PONG", b"PONG", True) for n, r in zip(nodes, replies, strict=True)}

    async def aclose(self) -> None:
        self._closed = True
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await self._refresh
        for batcher in [*self._nodes.values(), *self._plain.values()]:
            await batcher.aclose()

    # -- routing -----------------------------------------------------------------
    def _node(self, addr: str, *, plain: bool = False) -> Batcher:
        if self._closed:  # e.g. a redirection still in flight at shutdown: a closed batcher
            raise NotRun("the gateway is shutting down")  # would open a connection, and leak it
        nodes = self._plain if plain and self.ack is not None else self._nodes
        batcher = nodes.get(addr)
        if batcher is None:
            host, port = _split(addr)
            pool = aioredis.BlockingConnectionPool(
                host=host,
                port=port,
                max_connections=2 if nodes is self._plain else self._max_connections,
                **self._kwargs,
            )
            ack = None if nodes is self._plain else self.ack
            batcher = Batcher(aioredis.Redis(connection_pool=pool), ack)
            nodes[addr] = batcher
            self._cover(addr, batcher)
        return batcher

    def _cover(self, addr: str, batcher: Batcher) -> None:
        """The covering write of a node's acknowledgement goes to a slot the map says it
        serves (a batch's first key may be a slot it no longer serves, or one it imports)."""
        slot = next((s for s, a in enumerate(self.owners) if a == addr), None)
        batcher.cover_key = None if slot is None else "{" + slot_tags()[slot] + "}"

    def _send(
        self, slot: int, command: tuple[Any, ...], source: str | None, resend: bool
    ) -> asyncio.Future[Any]:
        """The hot path: the command joins its primary's batch of this tick; a future (no task)
        that a redirection, if any, resolves later."""
        owner = self.owners[slot]
        if owner is None:
            return asyncio.ensure_future(
                self._redirected(slot, command, source, resend, None, None)
            )
        inner = self._node(owner).submit(command, source, resend=resend)
        outer: asyncio.Future[Any] = inner.get_loop().create_future()

        def settle(done: asyncio.Future[Any]) -> None:
            if outer.done():  # the caller gave up
                if not done.cancelled():
                    done.exception()  # retrieved: no "never retrieved" warning
                return
            if done.cancelled():
                outer.cancel()
                return
            error = done.exception()
            if error is None:
                outer.set_result(done.result())
            elif isinstance(error, _REDIRECTED) and not isinstance(error, NotReplicated):
                task = asyncio.ensure_future(
                    self._redirected(slot, command, source, resend, owner, error)
                )
                task.add_done_callback(lambda t: _copy(t, outer))
            else:
                outer.set_exception(error)

        inner.add_done_callback(settle)
        return outer

    async def _redirected(
        self,
        slot: int,
        command: tuple[Any, ...],
        source: str | None,
        resend: bool,
        tried: str | None,
        error: BaseException | None,
    ) -> Any:
        deadline = time.monotonic() + self._timeout
        may_have_run = False
        asking: str | None = None
        backoff = 0.01
        for _ in range(_MAX_REDIRECTS * 4):
            if isinstance(error, NotReplicated):  # it ran; its 503 is the acknowledgement's
                if error.stale_map:  # the covering write went to a slot this node lost
                    self._refresh_soon()
                raise error
            if error is not None:
                if isinstance(error, MovedError):
                    self.redirects["moved"] += 1
                    self.owners[slot] = f"{error.host}:{error.port}"
                    self._refresh_soon()
                    asking = None
                elif isinstance(error, AskError):
                    self.redirects["ask"] += 1
                    asking = f"{error.host}:{error.port}"
                elif isinstance(error, TryAgainError):
                    self.redirects["tryagain"] += 1
                    asking = None
                    if time.monotonic() + backoff > deadline:
                        break
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 0.2)
                elif isinstance(error, ClusterDownError):
                    self._refresh_soon()
                    break
                else:  # the node is unreachable or the connection dropped
                    if not isinstance(error, NotSent):
                        may_have_run = True
                        if not resend:
                            raise error
                    asking = None
                    await self.refresh(avoid=tried)
                    if self.owners[slot] in (None, tried):
                        break
                    self.redirects["failover"] += 1
                if source is not None:  # a script about to be sent again: SEEN as of now
                    command = self.reseen(slot, command)
            elif self.owners[slot] is None:
                await self.refresh()
            target = asking or self.owners[slot]
            if target is None:
                error = NotRun(f"no node of the cluster serves slot {slot}")
                break
            if time.monotonic() > deadline:
                break
            tried = target
            try:
                return await self._node(target).submit(
                    command, source, resend=resend, asking=asking is not None
                )
            except _REDIRECTED as exc:
                error = exc
        assert error is not None
        if may_have_run:  # the store treats it as "may have been applied" (maybe_applied)
            raise error
        if isinstance(error, NotSent):
            raise error
        raise NotRun(f"the cluster did not run the command: {type(error).__name__} {error}")

    def reseen(self, slot: int, command: tuple[Any, ...]) -> tuple[Any, ...]:
        """``command`` as it is sent again now: its trailer's SEEN raised to the highest
        counter of ``slot`` seen by now (never lowered)."""
        i = len(command) - _SEEN_FROM_END
        seen = max(int(command[i]), self._seen.get(slot, 0))
        return (*command[:i], str(seen), *command[i + 1 :])

    # -- the slot map -------------------------------------------------------------
    def _refresh_soon(self) -> None:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._read_map(None))

    async def refresh(self, *, avoid: str | None = None, force: bool = False) -> None:
        """Read the slot map again (one read in flight; none if one ended < 50 ms ago)."""
        if self._refresh is not None and not self._refresh.done():
            await asyncio.shield(self._refresh)
            return
        if not force and time.monotonic() - self._refreshed_at < 0.05:
            return
        self._refresh = asyncio.ensure_future(self._read_map(avoid))
        await asyncio.shield(self._refresh)

    async def _read_map(self, avoid: str | None) -> None:
        known = [a for a in dict.fromkeys(self.owners) if a is not None]
        candidates = dict.fromkeys([*known, *self._seeds, *self._nodes, *self._plain])
        order = [a for a in candidates if a != avoid]
        if avoid is not None:
            order.append(avoid)
        for addr in order:
            if self._closed:
                return
            try:
                reply = await self.execute_on(addr, "CLUSTER", "SLOTS")
            except (RedisError, OSError):
                continue
            owners = parse_slots(reply)
            if owners != self.owners:
                log.info(
                    "cluster_map_changed",
                    primaries=sorted({a for a in owners if a is not None}),
                    uncovered=owners.count(None),
                    via=addr,
                )
            self.owners = owners
            self._refreshed_at = time.monotonic()
            for node, batcher in self._nodes.items():
                self._cover(node, batcher)
            return
        self._refreshed_at = time.monotonic()
        log.warning("cluster_map_unreadable", tried=order)
