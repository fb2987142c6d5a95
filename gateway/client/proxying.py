"""What an unmodified HTTP client's call needs to be a fenced step: the step and the target.

The optional transports (:mod:`gateway.client.httpx_transport`,
:mod:`gateway.client.requests_adapter`, :mod:`gateway.client.stripe_client`) are thin shells
around the two things here, which need no HTTP library:

- the **current step** (:func:`fenced_step`, which ``FencedJob.step(name)`` opens): a context
  variable holding the job and the step name, so the code inside ``with job.step("charge"):``
  — every task and thread started from it too — sends ``Fencing-Token``, ``Fencegate-Job``,
  ``Fencegate-Step`` and ``Worker-Id`` with no change at its call sites;
- the **route** (:class:`ProxyRoute`): a request to the upstream's own base URL (e.g.
  ``https://api.partner.com/v1/orders``) is rewritten to ``<gateway>/proxy/<upstream>/v1/orders``
  with the query kept; a request already under ``<gateway>/proxy/<upstream>`` is sent as it is;
  any other URL is refused before anything is sent (a fencing token never leaves for a host
  the route does not name).

Which step, in order: the innermost ``with job.step(name)`` around the call, else the route's
own ``job`` and ``step`` (a client bound to one step). An unsafe request (POST, PUT, PATCH,
DELETE) with no step raises :class:`~gateway.core.errors.InvalidRequest` before anything is
sent (the gateway would refuse it with the same 400) — unless the request names its own
``Fencegate-Step``, which is then sent as the client wrote it, or the route says the
upstream's ``step_from`` names it (``step_from=True``: sent with the route's job and no
step); a read (GET, HEAD) is sent
with the job's headers when there is a step, and without them when there is none (reads are
not fenced). A job already superseded raises its error (``StaleGeneration`` …) instead of
sending.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from gateway.core.errors import FencegateError, InvalidRequest

__all__ = [
    "STEP_HEADERS",
    "FencedStep",
    "JobLike",
    "ProxyRoute",
    "current_step",
    "fenced_step",
]

UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# what the route sets on every request it sends (and what it takes away from the client's)
STEP_HEADERS = ("Fencing-Token", "Fencegate-Job", "Fencegate-Step", "Worker-Id")


class JobLike(Protocol):
    """What a step needs of its job (``FencedJob`` and ``SyncFencedJob`` are)."""

    @property
    def job_id(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def worker_id(self) -> str | None: ...
    @property
    def superseded(self) -> FencegateError | None: ...


@dataclass(frozen=True, slots=True)
class FencedStep:
    """One step of one job: the headers a proxied call of it carries."""

    job: JobLike
    step: str

    def headers(self) -> dict[str, str]:
        """The step's request headers; raises the job's error if it is superseded."""
        if self.job.superseded is not None:
            raise self.job.superseded
        h = {
            "Fencing-Token": self.job.token,
            "Fencegate-Job": self.job.job_id,
            "Fencegate-Step": self.step,
        }
        if self.job.worker_id:
            h["Worker-Id"] = self.job.worker_id
        return h


_CURRENT: ContextVar[FencedStep | None] = ContextVar("fencegate_step", default=None)


def current_step() -> FencedStep | None:
    """The innermost ``with job.step(name)`` of this task or thread, or None."""
    return _CURRENT.get()


@contextmanager
def fenced_step(job: JobLike, step: str) -> Iterator[FencedStep]:
    """Make ``step`` of ``job`` the current step inside the ``with`` block."""
    current = FencedStep(job, step)
    reset = _CURRENT.set(current)
    try:
        yield current
    finally:
        _CURRENT.reset(reset)


def _prefix(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} must be an http:// or https:// URL")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must have no query or fragment")
    return url.rstrip("/")


def _under(url: str, prefix: str) -> str | None:
    """The rest of ``url`` after ``prefix`` (its path's rest and its query), or None when
    ``url`` is not under it (scheme and host compare case-insensitively, the path exactly)."""
    u, p = urlsplit(url), urlsplit(prefix)
    if (u.scheme.lower(), u.netloc.lower()) != (p.scheme.lower(), p.netloc.lower()):
        return None
    if u.path != p.path and not u.path.startswith(p.path + "/"):
        return None
    return u.path[len(p.path) :] + (f"?{u.query}" if u.query else "")


@dataclass(frozen=True)
class ProxyRoute:
    """Where a client's requests go and which step they are.

    ``gateway_url``: fencegate's base URL; ``upstream``: the ``[upstreams.<name>]`` name;
    ``base_url``: the upstream's own base URL as the client calls it (None: the client's own
    base URL already points at ``<gateway>/proxy/<upstream>``); ``api_key``: the worker's
    fencegate key, sent as ``Authorization: Bearer`` in place of whatever the client sends
    there (None: the client's own ``Authorization`` is sent — the SDK's API key set to the
    fencegate key); ``job`` and ``step``: the step when no ``with job.step()`` is current;
    ``step_from``: the upstream names the step of a request that sends none (its
    ``step_from`` setting, which the client cannot see): an unsafe request with no step is
    sent with ``job``'s headers and no ``Fencegate-Step``, and the gateway derives the step
    (or refuses it, 400) — it needs ``job``.
    """

    gateway_url: str
    upstream: str
    base_url: str | None = None
    api_key: str | None = None
    job: JobLike | None = None
    step: str | None = None
    step_from: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "gateway_url", _prefix(self.gateway_url))
        if self.base_url is not None:
            object.__setattr__(self, "base_url", _prefix(self.base_url))
        if not self.upstream or "/" in self.upstream:
            raise ValueError(f"upstream {self.upstream!r} must be an [upstreams.<name>] name")
        if self.step is not None and self.job is None:
            raise ValueError("a default step needs its job")
        if self.step_from and self.job is None:
            raise ValueError("step_from needs the job its requests are steps of (job=)")

    @property
    def proxy_url(self) -> str:
        return f"{self.gateway_url}/proxy/{self.upstream}"

    def current(self) -> FencedStep | None:
        """The step of a call made now: the current ``with job.step()``, else the route's."""
        found = current_step()
        if found is not None:
            return found
        if self.job is not None and self.step is not None:
            return FencedStep(self.job, self.step)
        return None

    def target(self, method: str, url: str) -> str:
        """The URL ``url`` is sent to; :class:`InvalidRequest` for a URL outside the route."""
        rest = _under(url, self.proxy_url)
        if rest is None and self.base_url is not None:
            rest = _under(url, self.base_url)
        if rest is None:
            where = f"{self.base_url} or {self.proxy_url}" if self.base_url else self.proxy_url
            raise InvalidRequest(
                f"{method} {url.split('?')[0][:200]} is not under {where}; nothing was sent"
            )
        return self.proxy_url + rest

    def headers(self, method: str, *, named: bool = False) -> dict[str, str]:
        """The headers to set on the request: the current step's (which replace the client's
        own :data:`STEP_HEADERS`) and the key. ``named``: the request carries its own
        ``Fencegate-Step``, sent as it is when no step is current; else an unsafe request
        with no step raises before sending (the module docstring)."""
        step = self.current()
        if step is None and not named and method.upper() in UNSAFE:
            if self.step_from and self.job is not None:  # the gateway derives the step
                out = FencedStep(self.job, "").headers()
                del out["Fencegate-Step"]
                if self.api_key is not None:
                    out["Authorization"] = f"Bearer {self.api_key}"
                return out
            raise InvalidRequest(
                f"{method} through the proxy needs a step: call it inside "
                "`with job.step(name):` (or give the transport job= and step=, or job= and "
                "step_from=True for an upstream whose step_from names it); nothing was sent"
            )
        out = step.headers() if step is not None else {}
        if self.api_key is not None:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out
