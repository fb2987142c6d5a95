"""Settings: a TOML file plus ``FENCEGATE_<SECTION>__<KEY>`` environment overrides.

This is the only module that reads the environment. Everything below it gets a
frozen :class:`Settings` (and resolved secrets) passed in.

Precedence, highest first: environment variables, the TOML file, defaults.
An unknown key or a value of the wrong type is a start-up error that names the
key (:class:`ConfigError`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.runtime.redis_settings import RedisSettings

__all__ = [
    "AuditSettings",
    "AuthKey",
    "AuthSettings",
    "BulkheadSettings",
    "CheckpointSettings",
    "ConfigError",
    "ConnectionSettings",
    "ConsoleSettings",
    "FencingSettings",
    "OutputSettings",
    "QuotaSettings",
    "RedisSettings",
    "ServerSettings",
    "Settings",
    "load_settings",
    "read_secret",
]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # use with fullmatch: "$" takes a "\n"
# [[auth.keys]] name: letters, digits and . _ - @ (an e-mail address fits), at most 64
KEY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HOST_ENTRY = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")
_ORIGIN = re.compile(r"https?://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")


class ConfigError(Exception):
    """The configuration cannot be used; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 262_144
    # Bounds on a JSON body's shape: nesting depth, values in total, one string's length.
    max_json_depth: Annotated[int, Field(ge=2, le=512)] = 32
    max_json_items: Annotated[int, Field(ge=10, le=1_000_000)] = 10_000
    max_string_bytes: Annotated[int, Field(ge=16, le=64 * 1024 * 1024)] = 65_536
    # On SIGTERM: how long in-flight dispatches may take to finish and record their
    # outcome; the rest are recorded as unknown.
    shutdown_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 10.0
    # /metrics answers only peers on a loopback address unless this is true
    # (put it behind your scrape network's own controls before enabling).
    metrics_public: bool = False
    # The canonical line per request: "all", or "problems" (responses >= 400 only,
    # rejections included; saves its CPU on the success path).
    request_log: Literal["all", "problems"] = "all"
    # "auto": uvloop when it is installed (the `fast` extra), else asyncio's own loop.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # Browsers (gateway.http.browser): the Host names this gateway answers to ("name" any port,
    # "name:port" that port, "*" any); unset: loopback names in open mode, any with keys.
    allowed_hosts: tuple[str, ...] | None = None
    # Origins whose requests are served (scheme://host[:port]); default none: a request
    # with an Origin header is refused. No CORS headers are sent either way.
    allowed_origins: tuple[str, ...] = ()

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        out = []
        for host in value:
            if host != "*" and not _HOST_ENTRY.fullmatch(host.lower()):
                raise ValueError(
                    f"{host!r} is not a host name, [IPv6] or IP, with an optional :port"
                )
            out.append(host.lower())
        return tuple(out)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for origin in value:
            if not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: scheme://host[:port] in lower case, no path "
                    "(no wildcards)"
                )
        return value

    @field_validator("event_loop")
    @classmethod
    def _loop_installed(cls, value: str) -> str:
        if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("uvloop is not installed: pip install 'fencegate[fast]'")
        return value


class FencingSettings(_Section):
    registration: Literal["required", "implicit"] = "required"
    dispatch_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 30
    retention_seconds: Annotated[int, Field(ge=60)] = 604_800
    # The relay: due steps taken per tenant per turn (fairness), and how often it reads
    # every slot's queue again (finds a step whose hint was lost in a crash).
    relay_per_tenant: Annotated[int, Field(ge=1, le=1000)] = 16
    relay_sweep_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # How often every gateway rebuilds the tenants' "needs a decision" hints from the slots'
    # indexes (a hint lost in a crash; a dispatch that passed its deadline shows up then).
    attention_reconcile_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0


class CheckpointSettings(_Section):
    """A job's checkpoints (``[checkpoints]``)."""

    # The largest checkpoint value (its JSON body, bytes); a larger one is refused with 413.
    max_bytes: Annotated[int, Field(ge=16, le=16 * 1024 * 1024)] = 65_536
    # The most checkpoint names one job holds: a new name past it is refused (413
    # too_many_checkpoints); writing a stored name again is always taken.
    max_per_job: Annotated[int, Field(ge=1, le=100_000)] = 100


class ConnectionSettings(_Section):
    """Connection hygiene of the HTTP server (``[connections]``)."""

    # Connections open at once. At the cap, the connection idle longest (a keep-alive one
    # whose last response is written counts), else the oldest still sending a request head,
    # is closed for the new one; if every one is serving a request, the new one gets 503
    # with Retry-After and is closed. Kept below the file-descriptor limit (raised at start).
    max: Annotated[int, Field(ge=8, le=1_000_000)] = 4096
    # A new connection must send a complete request head within this, and a keep-alive
    # connection is closed after this long idle.
    idle_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0
    # A request's whole body must arrive within this (else 408 and the connection closes).
    body_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    retry_after_seconds: Annotated[int, Field(ge=1, le=3600)] = 1
    # One tenant's share of `max`: connections whose first authenticated request (API key or
    # console login) named the tenant. Past it, that tenant's connection idle longest is
    # closed for the new one, else the new one gets 429 too_many_held and is closed. 0: half
    # of `max` when the deployment has several tenants, no share with one.
    max_per_tenant: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    backlog: Annotated[int, Field(ge=16, le=65535)] = 1024
    # Lines per second from the server's own loggers (aiohttp, asyncio); the rest are
    # counted and reported in one JSON line.
    log_lines_per_second: Annotated[float, Field(gt=0, le=100_000)] = 20.0


class BulkheadSettings(_Section):
    """HTTP connection pools of the adapters (``[bulkheads]``)."""

    # One bounded pool per adapter, and per tenant of an adapter when per_tenant is true.
    connections_per_pool: Annotated[int, Field(ge=1, le=10_000)] = 32
    # How long a send may wait for a connection of its pool; past it nothing was sent and
    # the step is released (502 adapter_unavailable).
    pool_wait_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    per_tenant: bool = True


class TenantQuota(_Section):
    effects_per_window: Annotated[int, Field(ge=0)] | None = None
    rejections_per_window: Annotated[int, Field(ge=0)] | None = None
    payload_bytes: Annotated[int, Field(ge=0)] | None = None
    checkpoint_bytes: Annotated[int, Field(ge=0)] | None = None


class QuotaSettings(_Section):
    """Per-tenant quotas (``[quotas]``, ``[quotas.tenants.<name>]``); 0 means no cap."""

    # Effect calls admitted or queued per tenant per window (replays, "in progress" answers
    # and rejections are not counted here).
    effects_per_window: Annotated[int, Field(ge=0)] = 0
    # Effect calls rejected by the fence per tenant per window that are audited one by one;
    # past it a rejection is still answered (409) and counted, not audited.
    rejections_per_window: Annotated[int, Field(ge=0)] = 0
    window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 3600
    # Async payload bytes a tenant may have stored for the relay at once (each payload
    # counts its size plus 1 KiB for the records around it).
    payload_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    # Checkpoint bytes a tenant may have stored, over all its jobs (each checkpoint counts
    # its stored record plus 256 bytes; freed when the job's checkpoints expire).
    checkpoint_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    # Retry-After of a 429 for stored payloads (the relay frees them as it delivers) and
    # for stored checkpoints.
    retry_after_seconds: Annotated[int, Field(ge=1, le=3600)] = 5
    tenants: dict[str, TenantQuota] = {}

    @property
    def enabled(self) -> bool:
        """Some tenant has a cap on effect calls: the effect service's admission hook is
        built (else nothing is called per effect call). ``checkpoint_bytes`` is charged by
        the checkpoint writes themselves, whatever this says."""
        caps = [self.effects_per_window, self.rejections_per_window, self.payload_bytes]
        for own in self.tenants.values():
            caps += [own.effects_per_window or 0, own.rejections_per_window or 0]
            caps.append(own.payload_bytes or 0)
        return any(caps)


Role = Literal["worker", "scheduler", "auditor", "admin"]


class AuthKey(_Section):
    role: Role
    sha256: str = ""
    key_env: str = ""
    tenant: str = "default"
    # Who holds the key (a person or a system): recorded as `by` with registrations and
    # operator resolutions. Unset: the role is recorded.
    name: str = ""

    @field_validator("name")
    @classmethod
    def _key_name(cls, v: str) -> str:
        if v and not KEY_NAME_RE.fullmatch(v):
            raise ValueError(f"name must match {KEY_NAME_RE.pattern}")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if v and not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError("must be the 64-character hex SHA-256 digest of the key")
        return v.lower()

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("tenant must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
        return v


class AuthSettings(_Section):
    # Names the env var holding the HMAC key(s); comma-separated for rotation, the first signs.
    token_signing_key_env: str = ""
    token_ttl_seconds: Annotated[int, Field(ge=60, le=90 * 86400)] = 86_400
    keys: tuple[AuthKey, ...] = ()


class AuditSettings(_Section):
    # Names the env var holding the audit chain's HMAC key(s); comma-separated for rotation,
    # the first keys new entries and anchors. Empty: an unkeyed chain (accidental damage only).
    key_env: str = ""
    # How often the heads of the chains this gateway extended are anchored outside Redis.
    anchor_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # The anchor file (JSON lines, append-only); empty: <redis.data_dir>/audit-anchors.jsonl.
    anchor_file: str = ""


class ConsoleSettings(_Section):
    """The web console under ``/console`` (``[console]``, gateway.console)."""

    enabled: bool = True
    # Hide and refuse the Resolve form for every key (an auditors' console).
    read_only: bool = False
    # How long a login lasts (the signed cookie's expiry).
    cookie_ttl_seconds: Annotated[int, Field(ge=60, le=7 * 86400)] = 8 * 3600
    # Names the env var with the secret that signs console cookies and CSRF tokens (the same in
    # every gateway host behind one name: set it when several hosts serve one console); empty:
    # a random secret kept in <redis.data_dir>/console.secret (mode 0600, created once, shared
    # by the workers and gateways of that data dir). Never derived from API or signing keys.
    secret_env: str = ""
    # Browsers reach the console over HTTPS through a TLS-terminating proxy in front of the
    # gateway: the login cookie is then __Host-fg_console (Secure, Path=/, no Domain), as it
    # is on a TLS connection. (List the https:// origin in server.allowed_origins too.)
    https: bool = False
    # Failed logins, counted in Redis (every process and host alike) in fixed windows: past
    # per_peer failures from one peer address, or total from all peers, logins are refused
    # with 429 and Retry-After until the window ends; 0 turns a limit off.
    login_failures_per_peer: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    login_failures_total: Annotated[int, Field(ge=0, le=1_000_000)] = 200
    login_window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 60
    # Live pages: how often the process reads the tenant feeds (one read per tenant with open
    # tabs, whatever the number of tabs), and the SSE keep-alive (a closed tab is noticed
    # within about this long).
    poll_seconds: Annotated[float, Field(ge=0.05, le=60)] = 1.0
    sse_ping_seconds: Annotated[float, Field(ge=0.1, le=60)] = 5.0
    # Live streams open at once per login (browser tabs) and per tenant, in each gateway
    # process; past either, a new one gets 429 too_many_held with Retry-After. 0: no cap.
    sse_per_session: Annotated[int, Field(ge=0, le=100_000)] = 4
    sse_per_tenant: Annotated[int, Field(ge=0, le=100_000)] = 16


class OutputSettings(_Section):
    """Attempt-scoped job outputs in an object store (``[outputs]``, docs/outputs.md)."""

    # "file": a directory on this machine (default: <redis.data_dir>-outputs, beside the
    # embedded Redis's data); "s3": a bucket of any S3-compatible service.
    store: Literal["file", "s3"] = "file"
    path: str = ""  # file store: the directory; empty: the sibling of redis.data_dir
    bucket: str = ""  # s3
    prefix: str = ""  # every key is <prefix><tenant>/<job>/g<generation>/<name>
    endpoint: str = ""  # s3: empty for AWS itself; http(s)://host:port for others
    region: str = "us-east-1"
    # s3 credentials: the names of the environment variables that hold them (never the
    # values); both empty: the ambient AWS credential chain of the process.
    access_key_id_env: str = ""
    secret_access_key_env: str = ""
    session_token_env: str = ""
    allow_http: bool = False  # s3: a plain-HTTP endpoint (a loopback test server)
    # file store: free space kept on its volume (plus redis.min_free_mb when the embedded
    # Redis's data dir is on the same volume): an upload that would go below it gets 507.
    min_free_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 256
    # One output's size bound: a larger body is refused with 413 while it streams.
    max_bytes: Annotated[int, Field(ge=1, le=5 * 1024**4)] = 1024**3
    # How long one upload through the gateway may take (the stage decision's deadline);
    # a presigned upload URL is valid this long.
    upload_timeout_seconds: Annotated[float, Field(gt=0, le=7 * 86_400)] = 3600.0
    # Uploads through the gateway running at once per tenant, in each gateway process; past
    # it, 429 too_many_held with Retry-After before anything is staged. 0: no cap.
    uploads_per_tenant: Annotated[int, Field(ge=0, le=100_000)] = 8
    # An upload slower than this, measured over each window of min_upload_window_seconds,
    # is cut with 408 request_timeout (nothing recorded, its claim freed). 0: no floor.
    min_upload_bytes_per_second: Annotated[int, Field(ge=0, le=1024**3)] = 1024
    min_upload_window_seconds: Annotated[float, Field(ge=1, le=3600)] = 10.0
    # Reads of a promoted output (S3): redirect to a signed GET URL instead of streaming.
    redirect_reads: bool = False
    # An orphan is deleted by the sweeper once it is older than this.
    orphan_grace_seconds: Annotated[float, Field(ge=0, le=365 * 86_400)] = 3600.0
    # How often each gateway sweeps (0: never; `fencegate outputs sweep` runs it once).
    sweep_interval_seconds: Annotated[float, Field(ge=0, le=86_400)] = 300.0

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v and (not v.endswith("/") or v.startswith("/") or ".." in v.split("/")):
            raise ValueError("prefix must be relative, end with '/' and have no '..' segment")
        return v


class Settings(BaseSettings):
    """The whole configuration, frozen once built."""

    model_config = SettingsConfigDict(
        env_prefix="FENCEGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    fencing: FencingSettings = FencingSettings()
    auth: AuthSettings = AuthSettings()
    audit: AuditSettings = AuditSettings()
    connections: ConnectionSettings = ConnectionSettings()
    bulkheads: BulkheadSettings = BulkheadSettings()
    quotas: QuotaSettings = QuotaSettings()
    console: ConsoleSettings = ConsoleSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    outputs: OutputSettings = OutputSettings()
    # Each adapter section is validated by its own type's model (adapters.registry).
    adapters: dict[str, dict[str, Any]] = {}

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, section in v.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"adapter name {name!r} must match {NAME_RE.pattern}")
            if "type" not in section:
                raise ValueError(f"[adapters.{name}] needs a 'type' key")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file arrives as init kwargs; environment variables win over it.
        return (env_settings, init_settings)


def _describe(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration in {origin}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {key}: {err['msg']}")
    return "\n".join(lines)


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build :class:`Settings` from an optional TOML file, the environment and overrides.

    ``overrides`` are section dicts (e.g. ``server={"port": 0}``) merged over the
    file; they are how the CLI's ``--host``/``--port``/``--redis-url`` flags land.
    """
    data: dict[str, Any] = {}
    origin = "defaults and environment"
    if path is not None:
        origin = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"configuration file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for section, values in overrides.items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origin)) from exc


def read_secret(env_name: str, what: str) -> str:
    """Read a secret from the environment variable the config names; never log it."""
    value = os.environ.get(env_name)
    if not value:
        raise ConfigError(f"{what}: environment variable {env_name} is not set or empty")
    return value
