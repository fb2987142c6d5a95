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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.core.names import NAME, NAME_RULE
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
    "ProxySettings",
    "QuotaSettings",
    "RedisSettings",
    "ServerSettings",
    "Settings",
    "load_settings",
    "read_secret",
]

# [[auth.keys]] name: letters, digits and . _ - @ (an e-mail address fits), at most 64
KEY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HOST_ENTRY = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")
_ORIGIN = re.compile(r"https?://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")


class ConfigError(Exception):
    """The configuration cannot be used; the message names the offending key."""


class _Section(BaseModel):
    # every field's docstring is its description: docs/configuration.md and the example
    # config are written from them (gateway.cli.configdoc)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ServerSettings(_Section):
    """The HTTP server (``[server]``)."""

    host: str = "127.0.0.1"
    """Bind address; without `[[auth.keys]]` only a loopback address is allowed."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    """TCP port (0: any free port)."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 262_144
    """Largest request body; a larger one gets 413 `payload_too_large`."""
    max_json_depth: Annotated[int, Field(ge=2, le=512)] = 32
    """Deepest nesting of a JSON body; deeper: 400."""
    max_json_items: Annotated[int, Field(ge=10, le=1_000_000)] = 10_000
    """JSON values in one body, in total; more: 400."""
    max_string_bytes: Annotated[int, Field(ge=16, le=64 * 1024 * 1024)] = 65_536
    """Longest string or object key anywhere in a JSON body; longer: 400."""
    shutdown_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 10.0
    """On SIGTERM, how long in-flight dispatches may take to finish and record their
    outcome; the rest are recorded `unknown`."""
    metrics_public: bool = False
    """`/metrics` answers only peers on a loopback address unless this is true (put it behind
    your scrape network's own controls before enabling)."""
    request_log: Literal["all", "problems"] = "all"
    """The canonical JSON line per request: `all`, or `problems` (responses >= 400 only;
    every rejection, with both generations, is still logged, and the audit log in Redis is
    unaffected): it saves the line's CPU on the success path (see
    [Performance](./performance.md#performance))."""
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """`auto`: uvloop when it is installed (`pip install 'fencegate[fast]'`; `make` and the
    Docker image install it), else asyncio's own loop; `uvloop` refuses to start without it;
    `asyncio`."""
    allowed_hosts: Annotated[
        tuple[str, ...] | None, Field(examples=[("gateway.internal", "gateway.internal:8443")])
    ] = None
    """The `Host` names this gateway answers to: `"name"` (any port), `"name:port"` (that
    port) or `"*"` (any); unset: loopback names in open mode, any name with keys; any other
    Host gets 403 (see [Security](./security.md#security))."""
    allowed_origins: tuple[str, ...] = ()
    """Origins (`scheme://host[:port]`) whose requests are served; a request with any other
    `Origin` header gets 403. No CORS headers are sent either way."""

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
    """The fence, the relay and the records (``[fencing]``)."""

    registration: Literal["required", "implicit"] = "required"
    """`required`: a job's generation comes from `POST /v1/jobs/{job}/register`; `implicit`:
    the highest generation seen so far is the fence (use it with signed tokens)."""
    dispatch_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 30
    """How long a dispatch may hold its step."""
    retention_seconds: Annotated[int, Field(ge=60)] = 604_800
    """How long effect records, checkpoints and audit entries are kept after their last use;
    fences and completions are never expired."""
    relay_sweep_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """How often the relay reads every slot's queue again: on a Cluster, a queued step whose
    hint was lost in a crash (between its admit and its hint) is relayed within this (on a
    standalone Redis the scripts write the hints themselves: the sweep only finds a hint
    removed by hand). An operator's trade-off on a Cluster, where each sweep reads all 16,384
    slot queues."""
    attention_reconcile_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0
    """How often one gateway of the deployment (the first to take the interval's turn)
    rebuilds the tenants' "needs a decision" hints from every slot's index: a hint lost in a
    crash reappears, and a dispatch past its deadline shows up in `GET /v1/attention` within
    this (see [How it is built](./architecture.md#needs-a-decision-the-index))."""


class CheckpointSettings(_Section):
    """A job's checkpoints (``[checkpoints]``)."""

    max_bytes: Annotated[int, Field(ge=16, le=16 * 1024 * 1024)] = 65_536
    """The largest checkpoint value (its JSON body, bytes); larger: 413
    (`server.max_body_bytes` bounds it too)."""
    max_per_job: Annotated[int, Field(ge=1, le=100_000)] = 100
    """The most checkpoint names one job holds: a new name past it gets 413
    `too_many_checkpoints`; a stored name can always be written again."""


class ConnectionSettings(_Section):
    """Connection hygiene of the HTTP server (``[connections]``)."""

    max: Annotated[int, Field(ge=8, le=1_000_000)] = 4096
    """Connections open at once, kept below the file-descriptor limit (raised at start). At
    the cap the connection idle longest (a keep-alive one is idle again once its response is
    written), else the oldest still sending its request head, is closed for the new one; if
    every one is serving a request, the new one gets 503 with `Retry-After` and is closed."""
    idle_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0
    """A new connection must send a complete request head within this, and a keep-alive
    connection is closed after this long idle."""
    body_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """A request's whole body must arrive within this, else 408 `request_timeout` and the
    connection closes."""
    retry_after_seconds: Annotated[int, Field(ge=1, le=3600)] = 1
    """`Retry-After` of the 503 at the cap."""
    max_per_tenant: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """One tenant's share of `connections.max`: connections whose first authenticated
    request (API key or console login) named the tenant. At the share, that tenant's
    connection idle longest is closed for the new one, else the new one gets 429
    `too_many_held` with `Retry-After` and is closed. 0: half of `max` when the deployment
    has several tenants, no share with one."""
    backlog: Annotated[int, Field(ge=16, le=65535)] = 1024
    """The listen backlog."""
    log_lines_per_second: Annotated[float, Field(gt=0, le=100_000)] = 20.0
    """Lines per second from the server's own loggers (aiohttp, asyncio), as JSON; the rest
    are counted and reported in one line (`suppressed`)."""


class BulkheadSettings(_Section):
    """HTTP connection pools of the adapters (``[bulkheads]``)."""

    connections_per_pool: Annotated[int, Field(ge=1, le=10_000)] = 32
    """HTTP connections of one adapter's pool (one pool per tenant with `per_tenant`)."""
    pool_wait_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How long a send may wait for a connection of its pool; past it nothing was sent and
    the step is released (502 `adapter_unavailable`)."""
    per_tenant: bool = True
    """A pool per adapter and tenant; `false`: one pool per adapter."""


class TenantQuota(_Section):
    """One tenant's own quotas (``[quotas.tenants.<tenant>]``); an unset key takes the
    ``[quotas]`` value."""

    effects_per_window: Annotated[int | None, Field(ge=0, examples=[100_000])] = None
    """This tenant's `quotas.effects_per_window`."""
    rejections_per_window: Annotated[int | None, Field(ge=0, examples=[10_000])] = None
    """This tenant's `quotas.rejections_per_window`."""
    payload_bytes: Annotated[int | None, Field(ge=0, examples=[16_777_216])] = None
    """This tenant's `quotas.payload_bytes`."""
    checkpoint_bytes: Annotated[int | None, Field(ge=0, examples=[16_777_216])] = None
    """This tenant's `quotas.checkpoint_bytes`."""
    output_bytes: Annotated[int | None, Field(ge=0, examples=[268_435_456])] = None
    """This tenant's `quotas.output_bytes`."""
    output_objects: Annotated[int | None, Field(ge=0, examples=[1000])] = None
    """This tenant's `quotas.output_objects`."""


class QuotaSettings(_Section):
    """Per-tenant quotas (``[quotas]``, ``[quotas.tenants.<tenant>]``); 0 means no cap."""

    effects_per_window: Annotated[int, Field(ge=0)] = 0
    """Effect calls admitted or queued per tenant per window (replays, "in progress" answers
    and rejections are not counted); past it 429 until the window ends; 0: no cap."""
    rejections_per_window: Annotated[int, Field(ge=0)] = 10_000
    """Rejections of fenced calls (effect calls, heartbeats, checkpoints, completions, output
    uploads, bad signed tokens) per tenant per window that are audited one by one; past it a
    rejection is still answered (409) and counted (`fencegate_quota_rejections`), not audited,
    and the feed gets a summary entry at most once a second; 0: no cap (a zombie flood grows
    the audit streams without bound)."""
    window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 3600
    """The window of `effects_per_window` and `rejections_per_window`."""
    payload_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    """Async payload bytes a tenant may have stored for the relay at once (each payload
    counts its size plus 1 KiB for the records around it); past it 429; 0: no cap."""
    checkpoint_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024
    """Checkpoint bytes a tenant may have stored over all its jobs (each checkpoint counts
    its stored record plus 256 bytes; freed when the job's checkpoints expire); over it only
    a checkpoint written again no larger is taken, the rest get 429; 0: no cap (nothing
    counted)."""
    output_bytes: Annotated[int, Field(ge=0)] = 1024 * 1024 * 1024
    """Bytes of outputs a tenant may have in the output store (staged, recorded or promoted:
    each object its size; an upload reserves its `Content-Length`, a chunked body 1 MiB at a
    time as it arrives, a presigned URL `outputs.max_bytes`); freed when the object is
    deleted (the sweeper, a failed upload); over it 429 `quota_exceeded`, nothing stored; 0:
    no cap (still counted). Charged by the uploads themselves, whatever the other caps say."""
    output_objects: Annotated[int, Field(ge=0)] = 10_000
    """Objects a tenant may have in the output store (an upload of a name already stored
    adds none); 0: no cap."""
    retry_after_seconds: Annotated[int, Field(ge=1, le=3600)] = 5
    """`Retry-After` of a payload-, checkpoint- or output-quota 429 (the relay frees payloads
    as it delivers); an effects 429 says when its window ends."""
    tenants: dict[str, TenantQuota] = {}
    """Per-tenant overrides, one table per tenant."""

    @property
    def enabled(self) -> bool:
        """Some tenant has a cap on effect calls: the effect service's admission hook is
        built (else nothing is called per effect call). ``checkpoint_bytes`` and the output
        caps are charged by the checkpoint writes and uploads themselves, whatever this
        says."""
        caps = [self.effects_per_window, self.rejections_per_window, self.payload_bytes]
        for own in self.tenants.values():
            caps += [own.effects_per_window or 0, own.rejections_per_window or 0]
            caps.append(own.payload_bytes or 0)
        return any(caps)


Role = Literal["worker", "scheduler", "auditor", "admin"]


class AuthKey(_Section):
    """One API key (``[[auth.keys]]``, one table per key): ``fencegate keys new --role
    worker --tenant default`` prints a key and its lines."""

    role: Annotated[Role, Field(examples=["worker"])]
    """`worker`, `scheduler`, `auditor` or `admin`."""
    sha256: Annotated[str, Field(examples=["<hex SHA-256 digest of the key>"])] = ""
    """The hex SHA-256 digest of the key (or set `key_env`)."""
    key_env: str = ""
    """The environment variable holding the key itself (instead of `sha256`)."""
    tenant: str = "default"
    """The tenant of the key: job ids live in its namespace."""
    name: Annotated[str, Field(examples=["alice@example.com"])] = ""
    """Who holds the key, a person or a system (`[A-Za-z0-9][A-Za-z0-9._@-]{0,63}`): recorded
    as `by` with every registration (and implicit registration) in the job's audit chain and
    with operator resolutions (`resolved_by`); unset: the role is recorded."""
    claims: bool = False
    """A `worker` key that may also claim: register the next generation of a job of its tenant
    it is starting (`POST /v1/jobs/{job}/generations`, allocated or the framework's own
    counter), and nothing else a scheduler may do; only on worker keys."""

    @field_validator("name")
    @classmethod
    def _key_name(cls, v: str) -> str:
        if v and not KEY_NAME_RE.fullmatch(v):
            raise ValueError(f"name must match {KEY_NAME_RE.pattern}")
        return v

    @model_validator(mode="after")
    def _claims_on_workers(self) -> AuthKey:
        if self.claims and self.role != "worker":
            raise ValueError(f"claims = true is for worker keys, not {self.role} keys")
        return self

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if v and not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError("must be the 64-character hex SHA-256 digest of the key")
        return v.lower()

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        if not NAME.fullmatch(v):
            raise ValueError(f"tenant {NAME_RULE}")
        return v


class AuthSettings(_Section):
    """API keys and signed tokens (``[auth]``). No keys: the gateway is open (every caller
    is `admin` of tenant `default`) and binds a loopback address only."""

    token_signing_key_env: str = ""
    """The environment variable holding the HMAC key(s) of signed tokens (>= 32 bytes),
    comma-separated for rotation (the first signs); empty: unsigned tokens."""
    token_ttl_seconds: Annotated[int, Field(ge=60, le=90 * 86400)] = 86_400
    """Lifetime of the signed tokens a registration returns."""
    keys: tuple[AuthKey, ...] = ()
    """The API keys, one `[[auth.keys]]` table each."""


class AuditSettings(_Section):
    """The audit chains and their anchors (``[audit]``)."""

    key_env: str = ""
    """The environment variable holding the audit chain's HMAC key(s), >= 16 bytes
    (`"new,old"` rotates: the first keys new entries and anchors, both verify); never stored
    in Redis, never logged. Empty: an unkeyed chain, which detects accidental damage only."""
    anchor_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """How often the heads of the chains this gateway extended are anchored outside Redis
    (also at shutdown); entries newer than a job's last anchor can be deleted without
    `audit verify` noticing."""
    anchor_file: str = ""
    """The anchor file (JSON lines, append-only, fsynced); empty:
    `<redis.data_dir>/audit-anchors.jsonl`."""


class ConsoleSettings(_Section):
    """The web console under ``/console`` (``[console]``, docs/console.md)."""

    enabled: bool = True
    """Serve the web console under `/console` (see [Console](./console.md#console))."""
    read_only: bool = False
    """Hide and refuse the console's Resolve form for every key (an auditors' console)."""
    cookie_ttl_seconds: Annotated[int, Field(ge=60, le=7 * 86400)] = 8 * 3600
    """How long a console login lasts (the signed cookie's expiry)."""
    secret_env: str = ""
    """The environment variable with the secret that signs console cookies, CSRF tokens and
    proofs of login: set it, the same on every host, when several hosts serve one console;
    empty: a random secret kept in `<redis.data_dir>/console.secret` (mode 0600, created
    once, shared by the workers and gateways of that data dir). Never derived from API,
    signing or audit keys."""
    https: bool = False
    """Browsers reach the console over HTTPS through a TLS-terminating proxy in front of the
    gateway: the login cookie is then `__Host-fg_console` (`Secure`, `Path=/`, no `Domain`),
    as on a TLS connection; list the `https://` origin in `server.allowed_origins` too."""
    login_failures_per_peer: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    """Failed console logins from one peer address per window (counted in Redis, every
    process and host alike); past it, 429 with `Retry-After` until the window ends; 0: no
    limit."""
    login_failures_total: Annotated[int, Field(ge=0, le=1_000_000)] = 200
    """The same for all peers together; 0: no limit."""
    login_window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 60
    """The window of both login counts (it starts at the first failure)."""
    poll_seconds: Annotated[float, Field(ge=0.05, le=60)] = 1.0
    """How often a process reads the tenant feeds that have open console tabs (one read per
    tenant, whatever the number of tabs): the live pages' delay against Redis reads per
    tenant."""
    sse_ping_seconds: Annotated[float, Field(ge=0.1, le=60)] = 5.0
    """Keep-alive of the console's live streams: a closed tab is noticed within about this
    long; keep it below the idle timeout of any proxy in front of the console."""
    sse_per_session: Annotated[int, Field(ge=0, le=100_000)] = 4
    """Live streams (browser tabs) open at once per login, in each gateway process; past it,
    429 `too_many_held` with `Retry-After`; 0: no cap."""
    sse_per_tenant: Annotated[int, Field(ge=0, le=100_000)] = 16
    """Live streams open at once per tenant, in each gateway process; past it, 429
    `too_many_held` with `Retry-After`; 0: no cap."""
    export_scan_entries: Annotated[int, Field(ge=500, le=10_000_000)] = 50_000
    """Feed entries one console export (rejections.csv / .json) looks at: past it the export
    ends early and names where to go on (`Fencegate-Export-Next`, passed back as `cursor`)."""
    exports_per_session: Annotated[int, Field(ge=0, le=1000)] = 1
    """Console exports running at once per login, in each gateway process; past it, 429
    `too_many_held`; 0: no cap."""
    exports_per_tenant: Annotated[int, Field(ge=0, le=1000)] = 2
    """Console exports running at once per tenant, in each gateway process; past it, 429
    `too_many_held`; 0: no cap."""
    chain_check_interval_seconds: Annotated[float, Field(ge=0, le=86_400)] = 60.0
    """A tenant's chain check (the Audit chain page) starts no sooner than this after its last
    one started (one at a time per tenant and process; a click in between shows the last)."""
    chain_check_max_entries: Annotated[int, Field(ge=10, le=100_000_000)] = 1_000_000
    """Audit entries one chain check reads over all the tenant's chains (in pages of 1,000);
    past it the check stops and says so, concluding nothing about the chain it stopped in."""


class OutputSettings(_Section):
    """Attempt-scoped job outputs in an object store (``[outputs]``, docs/outputs.md)."""

    store: Literal["file", "s3"] = "file"
    """Where outputs go (see [Outputs](./outputs.md#outputs)): `file`, a directory on this
    machine; `s3`, a bucket of any S3-compatible service."""
    path: str = ""
    """File store: the directory; empty: `<redis.data_dir>-outputs`, beside the embedded
    Redis's data (`make run` needs nothing)."""
    bucket: str = ""
    """S3: the bucket (required)."""
    prefix: str = ""
    """Every key is `<prefix><tenant>/<job>/g<generation>/<name>`: empty, or a relative
    prefix that ends with `/`."""
    endpoint: str = ""
    """S3: empty for AWS itself; `http(s)://host:port` for others (MinIO, Ceph, R2 ...)."""
    region: str = "us-east-1"
    """S3: the region."""
    access_key_id_env: str = ""
    """S3: the environment variable that holds the access key id (never the value); this and
    `secret_access_key_env` empty: the ambient AWS credential chain of the process."""
    secret_access_key_env: str = ""
    """S3: the environment variable that holds the secret access key."""
    session_token_env: str = ""
    """S3: the environment variable that holds a session token (temporary credentials)."""
    allow_http: bool = False
    """S3: a plain-HTTP endpoint (a loopback test server only)."""
    min_free_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 256
    """File store: free space kept on its volume (plus `redis.min_free_mb` when the embedded
    Redis's data dir is on the same volume): an upload that would go below it gets 507
    `insufficient_storage`."""
    max_bytes: Annotated[int, Field(ge=1, le=5 * 1024**4)] = 1024**3
    """One output's size bound: 413 as soon as a streamed body passes it (never buffered); a
    presigned upload larger than it is deleted at completion (413, nothing recorded)."""
    upload_timeout_seconds: Annotated[float, Field(gt=0, le=7 * 86_400)] = 3600.0
    """How long one upload through the gateway may take (its claim's deadline); a presigned
    upload URL is valid this long."""
    uploads_per_tenant: Annotated[int, Field(ge=0, le=100_000)] = 8
    """Uploads through the gateway running at once per tenant, in each gateway process; past
    it, 429 `too_many_held` with `Retry-After` before anything is staged; 0: no cap."""
    min_upload_bytes_per_second: Annotated[int, Field(ge=0, le=1024**3)] = 1024
    """An upload slower than this over a window of `min_upload_window_seconds` (time spent
    waiting for the client only) is cut with 408 `request_timeout`, nothing recorded, its
    claim freed; 0: no floor."""
    min_upload_window_seconds: Annotated[float, Field(ge=1, le=3600)] = 10.0
    """The window of `min_upload_bytes_per_second`: a client may stall this long before the
    floor applies."""
    redirect_reads: bool = False
    """S3: `GET .../outputs/{name}` answers 307 to a signed GET URL (valid 300 s) instead of
    streaming, for inert media types only (images, archives, `application/octet-stream`);
    every other type streams as an attachment."""
    orphan_grace_seconds: Annotated[float, Field(ge=0, le=365 * 86_400)] = 3600.0
    """An orphan object is deleted by the sweeper once older than this (auditors can read it
    meanwhile)."""
    sweep_interval_seconds: Annotated[float, Field(ge=0, le=86_400)] = 300.0
    """How often each gateway runs the orphan sweeper (0: never; `fencegate outputs sweep`
    runs it once)."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v and (not v.endswith("/") or v.startswith("/") or ".." in v.split("/")):
            raise ValueError("prefix must be relative, end with '/' and have no '..' segment")
        return v


class ProxySettings(_Section):
    """Request bodies of the reverse proxy (``[proxy]``, docs/proxy.md#bodies); every
    upstream alike."""

    buffer_bytes: Annotated[int, Field(ge=1024, le=64 * 1024**2)] = 262_144
    """A proxied request body (decoded) up to this is held in memory; a longer one is
    spooled to a file (`spool_bytes`), or 413 when spooling is off."""
    spool_bytes: Annotated[int, Field(ge=0, le=64 * 1024**3)] = 0
    """The longest body spooled to disk, per request, as sent and decoded (longer: 413);
    0: no spooling, a body over `buffer_bytes` is 413."""
    spool_dir: str = ""
    """Where spooled bodies are written (files of mode 0600, removed once the request is
    answered, refused, or its client went away); empty: `<redis.data_dir>/proxy-spool`."""
    spool_bytes_per_tenant: Annotated[int, Field(ge=0, le=1024**4)] = 256 * 1024**2
    """The bytes one tenant's requests may have spooled at once, in each gateway process;
    past it, 503 `too_many_held` with `Retry-After`, the file removed, nothing sent (other
    tenants unaffected); 0: no cap of its own."""
    spool_bytes_total: Annotated[int, Field(ge=0, le=1024**4)] = 1024**3
    """The bytes all tenants' requests may have spooled at once, in each gateway process;
    past it, the same 503; 0: no cap."""

    @model_validator(mode="after")
    def _one_body_fits(self) -> ProxySettings:
        # a body the caps could never hold would be refused as "later" forever
        for cap in ("spool_bytes_per_tenant", "spool_bytes_total"):
            if getattr(self, cap) and self.spool_bytes > getattr(self, cap):
                raise ValueError(f"spool_bytes ({self.spool_bytes}) is more than {cap}")
        return self


class Settings(BaseSettings):
    """The whole configuration, frozen once built."""

    model_config = SettingsConfigDict(
        env_prefix="FENCEGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    # the sections in the order docs/configuration.md and the example config list them
    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    connections: ConnectionSettings = ConnectionSettings()
    bulkheads: BulkheadSettings = BulkheadSettings()
    quotas: QuotaSettings = QuotaSettings()
    fencing: FencingSettings = FencingSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    auth: AuthSettings = AuthSettings()
    audit: AuditSettings = AuditSettings()
    console: ConsoleSettings = ConsoleSettings()
    outputs: OutputSettings = OutputSettings()
    proxy: ProxySettings = ProxySettings()
    adapters: dict[str, dict[str, Any]] = {}
    """One `[adapters.<name>]` table per adapter; `<name>` is what requests use, its `type`
    chooses the model that validates the rest (the keys below and
    [Adapters](./adapters.md#adapters))."""

    upstreams: dict[str, dict[str, Any]] = {}
    """One `[upstreams.<name>]` table per upstream of the reverse proxy
    (`/proxy/<name>/<rest>`); validated at start by gateway.proxy.config (the keys in
    [Proxy mode](./proxy.md#configuration))."""

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, section in v.items():
            if not NAME.fullmatch(name):
                raise ValueError(f"adapter name {name!r} {NAME_RULE}")
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
