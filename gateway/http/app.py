"""``create_app(settings, redis_url=…)`` → the aiohttp application.

Resources live in two ``cleanup_ctx`` in dependency order: Redis and the store with its
periodic ticks (:func:`_store_lifetime`), then the adapters on their pools and the effect
service (:func:`_service_lifetime`, whose cleanup stops the relay and records what the
shutdown's drain left before the adapters close).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import aiohttp
import structlog
from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute

from adapters.base import Adapter, AdapterContext
from adapters.registry import build_adapters, validate_configs
from gateway import console
from gateway.core.errors import FencegateError, InternalError, StoreUnavailable
from gateway.core.reasons import REFUSALS
from gateway.core.tokens import TokenSigner
from gateway.fencing.bulkheads import HttpPools, scope_adapters
from gateway.fencing.completion import CompletionService
from gateway.fencing.outputs import OutputService
from gateway.fencing.outputs_sweep import sweep as sweep_outputs
from gateway.fencing.quotas import CHECKPOINT_OVERHEAD, Quotas
from gateway.fencing.service import EffectService
from gateway.fencing.tenancy import Tenancy, resolve_tenancy
from gateway.http import appkeys as K
from gateway.http.auth import Authenticator
from gateway.http.browser import GUARD as BROWSER_GUARD
from gateway.http.browser import BrowserGuard
from gateway.http.codings import HANDLER_ARGS
from gateway.http.connections import GUARD, GuardSlot, body_refusal, guard_of, write_response
from gateway.http.expect import continue_now
from gateway.http.hotlane import HOT_LANE, HotLane
from gateway.http.job_state_views import JOB_ROUTES
from gateway.http.openapi import openapi_document
from gateway.http.outputs import OUTPUT_ROUTES, OUTPUTS
from gateway.http.problems import from_http_exception, problem_response
from gateway.http.proxied import mount_proxy
from gateway.http.tenantshare import claim_connection, share_refusal
from gateway.http.views import HOT_HANDLERS, ROUTES
from gateway.objects import ObjectStore, build_object_store
from gateway.objects.space import SpaceFloor
from gateway.runtime.logging import end_request, flush_logs, log_request, request_context
from gateway.runtime.metrics import Metrics
from gateway.runtime.periodic import every
from gateway.runtime.periodic import stop as stop_tickers
from gateway.runtime.settings import ConfigError, Settings, read_secret
from gateway.store import anchors as anchors_module
from gateway.store.jobstate import JobState
from gateway.store.replication import AckPolicy
from gateway.store.store import Store, connect
from gateway.store.topology import Topology
from gateway.store.topology import watch as watch_topology

__all__ = ["create_app"]

log = structlog.get_logger("fencegate")

SecretReader = Callable[[str, str], str]
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,64}")  # echoed as a header: printable ASCII only


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CleanupContext = Callable[[web.Application], AsyncIterator[None]]


def _middleware(body_timeout: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The gateway's one middleware (each layer aiohttp runs costs a call and a coroutine per
    request, so its parts are plain calls in one). Outermost first: the connection guard's
    serving span (:func:`gateway.http.connections.serving`), problems for every error and one
    canonical log line per request, the tenant's share of the connections
    (:func:`gateway.http.tenantshare.share_refusal`), the body deadline
    (:func:`gateway.http.connections.body_refusal`)."""

    @web.middleware
    async def gateway(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = guard_of(request)
        if guard is None:
            return await _answer(request, handler, body_timeout)
        transport = request.transport
        guard.serving(transport)
        try:
            response = await _answer(request, handler, body_timeout)
            await write_response(request, response)
            return response
        finally:
            guard.finished(transport)

    return gateway


async def _answer(
    request: web.Request, handler: Handler, body_timeout: float
) -> web.StreamResponse:
    """Problems for every error, and one canonical log line per request."""
    # a correlation id, not a secret: the PRNG, not a getrandom() system call per request
    request_id = request.headers.get("X-Request-Id", "")[:64]
    if not _REQUEST_ID.fullmatch(request_id):
        request_id = f"{random.getrandbits(64):016x}"
    context = request_context(request_id=request_id)
    started = time.perf_counter()
    metrics = request.app[K.METRICS]
    error: FencegateError | None = None
    try:
        if not console.owns(request):  # the console's pages apply their own (gateway.console)
            request.app[BROWSER_GUARD].check(request)  # browsers, foreign Hosts, non-JSON bodies
        # (a response is a mapping: an empty one is falsy)
        refusal: web.StreamResponse | None = share_refusal(request)
        if refusal is None:
            refusal = await body_refusal(request, body_timeout)
        response = refusal if refusal is not None else await handler(request)
    except FencegateError as exc:
        error = exc
    except web.HTTPException as exc:
        error = from_http_exception(exc)
    except Exception:
        log.exception("unhandled_error", method=request.method, path=request.path)
        error = InternalError("internal error; see the gateway's log for the request id")
    if error is not None:
        response = problem_response(error)
        metrics.problem_counter(error.code, str(error.http_status)).inc()
        if error.code in REFUSALS:  # the audited refusals (gateway.core.reasons)
            metrics.rejection_counter(error.code).inc()
            context["presented"] = error.fields.get("presented")
            context["current"] = error.fields.get("current")
        context["outcome"] = error.code
    assert isinstance(response, web.StreamResponse)
    response.headers["X-Request-Id"] = request_id
    elapsed = time.perf_counter() - started
    route = request.match_info.route.resource
    metrics.request_timer(route.canonical if route else "-").observe(elapsed)
    end_request()  # the context goes into this line explicitly, whatever the processor chain
    if response.status < 400 and request.app[K.SETTINGS].server.request_log == "problems":
        return response
    log_request(  # a copy: tasks the request spawned still hold its context
        {
            **context,
            "method": request.method,
            "path": request.path,
            "status": response.status,
            "ms": round(elapsed * 1000, 3),
        }
    )
    return response


def _ack_policy(settings: Settings) -> AckPolicy | None:
    redis = settings.redis
    return (
        AckPolicy(redis.replicas_acked, redis.replica_ack_timeout_ms)
        if redis.replicas_acked
        else None
    )


def _token_signer(settings: Settings, secret: SecretReader) -> TokenSigner | None:
    """The signer of fencing tokens (``auth.token_signing_key_env``), else None: unsigned."""
    if not settings.auth.token_signing_key_env:
        return None
    raw = secret(settings.auth.token_signing_key_env, "auth.token_signing_key_env")
    try:
        return TokenSigner(
            [k.strip().encode() for k in raw.split(",") if k.strip()],
            settings.auth.token_ttl_seconds,
        )
    except ValueError as exc:
        raise ConfigError(f"auth.token_signing_key_env: {exc}") from exc


def _space_floors(settings: Settings) -> list[SpaceFloor]:
    """The free-space floors /readyz reports: the embedded Redis's volume (its data dir made
    here); uploads stop before it fills."""
    floors: list[SpaceFloor] = []
    if not settings.redis.url and settings.redis.min_free_mb:
        data = Path(settings.redis.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        floors.append(SpaceFloor(data, settings.redis.min_free_mb * 1024 * 1024))
    return floors


# -- the store's lifetime: open, start, the parts built on it, the periodic checks, close ----


def _open_store(
    settings: Settings, redis_url: str, state_file: Path | None, audit_keys: list[str]
) -> Store:
    """The store on its own Redis client (closed by ``Store.close``; nothing sent yet)."""
    client = connect(
        redis_url,
        timeout=settings.redis.timeout_seconds,
        max_connections=settings.redis.max_connections,
        cluster=settings.redis.cluster,
    )
    store = Store(
        client,
        registration=settings.fencing.registration,
        dispatch_timeout_ms=int(settings.fencing.dispatch_timeout_seconds * 1000),
        retention_seconds=settings.fencing.retention_seconds,
        state_file=state_file,
        request_memory_seconds=settings.redis.request_memory_seconds,
        audit_key=audit_keys[0] if audit_keys else "",
        ack=_ack_policy(settings),
    )
    return store


async def _start_store(store: Store, settings: Settings) -> None:
    """Load the scripts and check (or, where allowed, write) the durability marker. A Redis
    that does not answer is logged, not fatal: the gateway starts and is not ready."""
    try:
        await store.load_scripts()
        # an external Redis is initialised by `fencegate init` (or redis.auto_init)
        write = not settings.redis.url or settings.redis.auto_init
        result = await store.initialize(auto=True, write=write)
        if result == "stale_snapshot":
            pass  # logged by the store; every dispatch fails closed until init
        elif result == "uninitialised":
            log.error("redis_not_initialised", detail=store.link.marker_missing_detail)
        elif result == "refused":
            log.error(
                "durability_marker_missing",
                detail="Redis lost fencegate's data or was replaced; dispatching is refused "
                "until an operator runs `fencegate init --confirm-data-loss`",
            )
        elif result == "written":
            log.info("durability_marker_written")
    except StoreUnavailable as exc:
        log.warning("redis_unavailable_at_start", detail=exc.detail)


def _store_parts(
    app: web.Application,
    settings: Settings,
    store: Store,
    objects: ObjectStore,
    crash_hook: Callable[[str], None] | None,
) -> None:
    """What the app holds on the store: the store, the job state, the quotas (also the
    store's rejections budget), the completion and the outputs (which record presigned
    uploads at completion)."""
    app[K.STORE] = store
    app[K.JOBSTATE] = JobState(
        store.link,
        store.decisions,
        registration=settings.fencing.registration,
        retention_seconds=settings.fencing.retention_seconds,
        max_checkpoints=settings.checkpoints.max_per_job,
        checkpoint_overhead=CHECKPOINT_OVERHEAD,
    )
    app[K.QUOTAS] = Quotas(
        store,
        settings.quotas,
        app[K.METRICS],
        retention_seconds=settings.fencing.retention_seconds,
    )
    store.link.rejection_budget = app[K.QUOTAS]  # heartbeats, checkpoints, completions, …
    # the object store's side sets .recorder (pre-signed uploads recorded at completion)
    app[K.COMPLETION] = CompletionService(
        app[K.JOBSTATE], app[K.QUOTAS], max_checkpoints=settings.checkpoints.max_per_job
    )
    app[K.METRICS].watch(store.batcher)
    app[OUTPUTS] = OutputService(
        store,
        objects,
        settings.outputs,
        crash_hook=crash_hook,
    )
    app[K.COMPLETION].recorder = app[OUTPUTS]  # presigned uploads recorded at completion


async def _epoch_tick(store: Store, settings: Settings) -> None:
    with contextlib.suppress(StoreUnavailable):
        await store.heartbeat_epoch()
    if settings.redis.url and not settings.redis.allow_volatile:
        await store.check_durability()  # changed since the start?


async def _marks_tick(store: Store) -> None:
    try:
        await store.persist_marks()
    except OSError as exc:
        log.error("state_file_write_failed", error=str(exc))
    await store.witness()  # lost writes, whoever wrote since (standalone)


async def _sweep_tick(app: web.Application, settings: Settings) -> None:
    try:
        await sweep_outputs(
            app[OUTPUTS],
            grace_seconds=settings.outputs.orphan_grace_seconds,
            metrics=app[K.METRICS],
        )
    except Exception as exc:  # a failed sweep is tried again next interval
        log.warning("output_sweep_failed", error=str(exc))


async def _attention_tick(store: Store, every_seconds: float) -> None:
    """The attention hints (gateway.store.attention): one gateway of the deployment per
    interval; not at start: the hints outlive a restart."""
    if await store.attention_index.take_turn(int(every_seconds * 1000)):
        await store.reconcile_attention()


def _start_tickers(
    app: web.Application, settings: Settings, store: Store, redis_url: str
) -> list[asyncio.Task[None]]:
    """The store's periodic work, each a task of :func:`gateway.runtime.periodic.every`: the
    epoch and durability, the slot marks and the witness, the attention reconciler, the
    outputs' orphan sweep (when on); and, with ``redis.replicas_acked``, the replication
    topology's watch. Stopped by :func:`gateway.runtime.periodic.stop`."""
    redis_settings = settings.redis
    attention_every = settings.fencing.attention_reconcile_seconds
    sweep_every = settings.outputs.sweep_interval_seconds
    loops = [
        every(
            lambda: redis_settings.epoch_interval_seconds,
            functools.partial(_epoch_tick, store, settings),
            name="epoch",
            quiet=(StoreUnavailable,),
        ),
        every(
            lambda: redis_settings.marks_interval_seconds,
            functools.partial(_marks_tick, store),
            name="marks",
            quiet=(StoreUnavailable,),
        ),
        every(
            lambda: attention_every,
            functools.partial(_attention_tick, store, attention_every),
            name="attention",
            quiet=(StoreUnavailable,),
        ),
    ]
    if sweep_every > 0:
        loops.append(
            every(
                lambda: sweep_every * random.uniform(0.8, 1.2),
                functools.partial(_sweep_tick, app, settings),
                name="sweep",
            )
        )
    tickers = [asyncio.create_task(loop) for loop in loops]
    if redis_settings.replicas_acked:  # the replication topology, checked periodically

        def topology(report: Topology) -> None:
            # allow_volatile waived the refusal at start: logged, not a readiness failure
            waived = redis_settings.allow_volatile
            store.link.topology_problems = [] if waived else report.problems

        tickers.append(
            asyncio.create_task(
                watch_topology(
                    redis_url,
                    redis_settings.replicas_acked,
                    redis_settings.topology_interval_seconds,
                    topology,
                    io_timeout=redis_settings.timeout_seconds,
                )
            )
        )
    return tickers


def _store_lifetime(
    settings: Settings,
    *,
    redis_url: str,
    state_file: Path | None,
    audit_keys: list[str],
    objects: ObjectStore,
    crash_hook: Callable[[str], None] | None,
) -> CleanupContext:
    """The cleanup context of Redis and the store: the first the app enters, the last it
    leaves (the adapters' context, which drains the dispatches, leaves before it)."""

    async def store_lifetime(app: web.Application) -> AsyncIterator[None]:
        store = _open_store(settings, redis_url, state_file, audit_keys)
        anchorer = store.anchorer(anchors_module.anchor_path(settings), audit_keys)
        await _start_store(store, settings)
        _store_parts(app, settings, store, objects, crash_hook)
        tickers = _start_tickers(app, settings, store, redis_url)
        anchorer.start(settings.audit.anchor_interval_seconds)
        yield
        await stop_tickers(tickers, settings.redis.timeout_seconds + 3)
        await anchorer.stop()  # the heads of the last interval, after the drain
        await store.close()

    return store_lifetime


# -- the adapters' and the effect service's lifetime ------------------------------------------


def _build_adapters(
    settings: Settings, tenancy: Tenancy, secret: SecretReader
) -> tuple[dict[str, Adapter], dict[str, HttpPools]]:
    """The adapters, each on its own bounded pools, one per tenant (fencing.bulkheads)."""
    sections = tenancy.sections(settings.adapters)
    pools = {name: HttpPools(name, settings.bulkheads) for name in sections}
    adapters: dict[str, Adapter] = {}
    for name, section in sections.items():
        http = cast(aiohttp.ClientSession, pools[name])  # stands in for a ClientSession
        adapters.update(build_adapters({name: section}, AdapterContext(http=http, secret=secret)))
    return scope_adapters(adapters), pools


async def _stop_relay(service: EffectService, relay: asyncio.Task[None], within: float) -> None:
    """Stop the relay's loop and wait for it at most ``within`` seconds (see Relay.run)."""
    service.relay.stop()
    relay.cancel()
    done, _ = await asyncio.wait({relay}, timeout=within)
    if relay not in done:  # never hang the shutdown on it
        log.error("relay_did_not_stop", detail="continuing the shutdown without it")


def _service_lifetime(
    settings: Settings,
    *,
    tenancy: Tenancy,
    secret: SecretReader,
    crash_hook: Callable[[str], None] | None,
) -> CleanupContext:
    """The cleanup context of the adapters and the effect service (entered after the store's):
    the relay runs while it is open; leaving it stops the relay, records what the shutdown's
    drain left, then closes the adapters and their pools."""

    async def service_lifetime(app: web.Application) -> AsyncIterator[None]:
        adapters, pools = _build_adapters(settings, tenancy, secret)
        app[K.ADAPTERS] = adapters
        # no cap on effect calls anywhere: no hook, nothing called per effect call
        quotas = app[K.QUOTAS] if settings.quotas.enabled else None
        service = app[K.SERVICE] = EffectService(
            app[K.STORE],
            adapters,
            app[K.METRICS],
            dispatch_timeout_seconds=settings.fencing.dispatch_timeout_seconds,
            tenant_keyed=tenancy.keyed,
            adapter_tenants=tenancy.allowed,
            crash_hook=crash_hook,
            admission=quotas,
        )
        relay = asyncio.create_task(
            service.relay.run(
                sweep_seconds=settings.fencing.relay_sweep_seconds,
            )
        )
        yield
        await _stop_relay(service, relay, settings.redis.timeout_seconds + 3)
        # on_shutdown drained with the grace period; record anything that slipped in since
        cut = await service.dispatcher.drain(0)
        if cut:
            log.warning("shutdown_cut_dispatches_short", count=cut, recorded_as="unknown")
        for adapter in adapters.values():
            await adapter.aclose()
        for pool in pools.values():
            await pool.close()

    return service_lifetime


def _drain_on_shutdown(
    settings: Settings, handle_signals: bool
) -> Callable[[web.Application], Awaitable[None]]:
    """The on_shutdown hook that runs before aiohttp waits for handlers: in-flight dispatches
    get the grace period, and a second SIGTERM/SIGINT during it cuts it short (the rest are
    recorded unknown)."""

    async def drain_on_shutdown(app: web.Application) -> None:
        second_signal = asyncio.Event()
        if handle_signals:  # only in `fencegate serve`, whose loop owns the process's signals
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(sig, second_signal.set)
        if K.SERVICE in app:
            cut = await app[K.SERVICE].dispatcher.drain(
                settings.server.shutdown_grace_seconds, second_signal
            )
            if cut:
                log.warning("shutdown_cut_dispatches_short", count=cut, recorded_as="unknown")

    return drain_on_shutdown


async def _flush_log_lines(app: web.Application) -> None:
    flush_logs()  # the buffered request lines of the last requests


def _add_routes(app: web.Application) -> dict[str, AbstractRoute]:
    """Mount the route table; returns the hot routes (the effect call and the heartbeat, which
    the hot lane serves) by their handler's name."""
    hot: dict[str, AbstractRoute] = {}
    # the router tries routes sharing a prefix in the order added: the hot ones first
    for route in sorted(
        (*ROUTES, *JOB_ROUTES, *OUTPUT_ROUTES), key=lambda r: r.handler not in HOT_HANDLERS
    ):
        added = app.router.add_route(
            route.method, route.path, route.handler, expect_handler=continue_now
        )
        if route.handler in HOT_HANDLERS:
            hot[route.handler.__name__] = added
    return hot


def create_app(
    settings: Settings,
    *,
    redis_url: str,
    state_file: Path | None = None,
    secret: SecretReader = read_secret,
    crash_hook: Callable[[str], None] | None = None,
    handle_signals: bool = False,
) -> web.Application:
    """Build the gateway. Adapter configs are validated here, before anything starts."""
    validate_configs(settings.adapters, secret)
    tenancy = resolve_tenancy(settings)
    middleware = _middleware(settings.connections.body_timeout_seconds)
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        handler_args=HANDLER_ARGS,  # bodies as sent: decoded by gateway.http.codings
        middlewares=[middleware],
    )
    app[GUARD] = GuardSlot()  # `fencegate serve` puts its connection guard here
    app[K.SETTINGS] = settings
    app[K.TENANCY] = tenancy
    app[K.METRICS] = Metrics()
    app[K.AUTH] = Authenticator(settings.auth.keys, secret)
    app[BROWSER_GUARD] = BrowserGuard(settings.server, open_mode=app[K.AUTH].open)
    app[K.OPENAPI] = openapi_document(proxy=bool(settings.upstreams))
    app[K.SIGNER] = _token_signer(settings, secret)
    audit_keys = anchors_module.audit_keys(settings, secret)  # never stored in Redis, never logged
    objects = build_object_store(settings, secret)  # outputs: config errors here
    app[K.FLOORS] = _space_floors(settings)
    app.on_shutdown.append(_drain_on_shutdown(settings, handle_signals))
    app.on_cleanup.append(_flush_log_lines)
    mount_proxy(app, settings, tenancy.tenants, secret)  # [upstreams.*]: /proxy/<name>/…
    app.cleanup_ctx.append(
        _store_lifetime(
            settings,
            redis_url=redis_url,
            state_file=state_file,
            audit_keys=audit_keys,
            objects=objects,
            crash_hook=crash_hook,
        )
    )
    app.cleanup_ctx.append(
        _service_lifetime(settings, tenancy=tenancy, secret=secret, crash_hook=crash_hook)
    )
    hot = _add_routes(app)
    app[HOT_LANE] = HotLane(middleware, hot["perform_effect"], hot["heartbeat"])
    # /console; its on_shutdown hook goes first: its open streams end before the drain
    console.mount(
        app,
        settings,
        secret=secret,
        audit_keys=audit_keys,
        keys=app[K.AUTH],
        host_allowed=app[BROWSER_GUARD].host_allowed,
        store=lambda: app[K.STORE],
        claim_connection=claim_connection,
    )
    return app
