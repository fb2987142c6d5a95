"""Role keys and tenants: ``Authorization: Bearer <key>`` → :class:`Principal`, and the
request's authentication and authorisation (:func:`caller_as`, :func:`job_as`).

Keys are configured as SHA-256 digests (or read from an env var and digested
at start); a presented key is digested and compared in constant time with
every configured digest. With no keys configured the gateway is open, every
caller is ``admin`` of tenant ``default``, and it only serves on loopback.

The app holds its :class:`Authenticator` under :data:`AUTH` (declared here, beside its
class, and named again in :mod:`gateway.http.appkeys`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

from gateway.core.errors import Forbidden, Unauthorized
from gateway.core.names import checked_name
from gateway.runtime.logging import bind
from gateway.runtime.settings import AuthKey
from gateway.store.keys import JobKeys

__all__ = ["AUTH", "OPEN", "Authenticator", "Principal", "caller_as", "job_as", "job_keys"]


@dataclass(frozen=True, slots=True)
class Principal:
    role: str
    tenant: str
    name: str = ""  # the key's optional name ([[auth.keys]] name)
    claims: bool = False  # a worker key that may register its jobs' generations ([[auth.keys]])

    @property
    def who(self) -> str:
        """Who acted, for the audit chain and records: the key's name, else its role."""
        return self.name or self.role

    def require(self, *roles: str) -> None:
        if self.role != "admin" and self.role not in roles:
            raise Forbidden(f"role {self.role!r} may not do this; needs one of {', '.join(roles)}")

    def require_registration(self) -> None:
        """Registering a generation: a scheduler's, or a worker key's with ``claims = true``
        (the one scheduler action such a key has)."""
        if self.role == "worker" and self.claims:
            return
        if self.role == "worker":
            raise Forbidden("this worker key may not register generations; it needs claims = true")
        self.require("scheduler")


OPEN = Principal(role="admin", tenant="default")


class Authenticator:
    def __init__(self, keys: Iterable[AuthKey], secret: Callable[[str, str], str]) -> None:
        self._keys: list[tuple[bytes, Principal]] = []
        for i, key in enumerate(keys):
            if key.key_env:
                digest = hashlib.sha256(
                    secret(key.key_env, f"auth.keys[{i}].key_env").encode()
                ).digest()
            elif key.sha256:
                digest = bytes.fromhex(key.sha256)
            else:
                raise ValueError(f"auth.keys[{i}] needs sha256 or key_env")
            self._keys.append((digest, Principal(key.role, key.tenant, key.name, key.claims)))

    @property
    def open(self) -> bool:
        return not self._keys

    def entries(self) -> tuple[tuple[bytes, Principal], ...]:
        """Every configured key as (SHA-256 digest, principal): the console's cookies name a key
        by a MAC of its digest, so a key removed from the config ends its console logins."""
        return tuple(self._keys)

    def authenticate(self, header: str | None) -> Principal:
        if not self._keys:
            return OPEN
        if not header or not header.startswith("Bearer "):
            raise Unauthorized("send Authorization: Bearer <key>")
        try:  # aiohttp hands undecodable header bytes on as lone surrogates
            presented = header[7:].strip().encode()
        except UnicodeEncodeError:
            raise Unauthorized("the API key is not valid UTF-8") from None
        digest = hashlib.sha256(presented).digest()
        found: Principal | None = None
        # Compare against every key so timing does not say which one matched.
        for known, principal in self._keys:
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None:
            raise Unauthorized("unknown API key")
        return found


AUTH = web.AppKey("auth", Authenticator)


def caller_as(request: web.Request, *roles: str) -> Principal:
    """Authenticate the request's ``Authorization`` and, given roles, authorise one of them
    (``admin`` may do anything). 401 for a missing or unknown key, 403 for another role."""
    principal = request.app[AUTH].authenticate(request.headers.get("Authorization"))
    if roles:
        principal.require(*roles)
    return principal


def job_as(request: web.Request, *roles: str) -> tuple[JobKeys, Principal]:
    """Authenticate, authorise, and name the job in the caller's tenant (no roles: the
    caller authorises itself afterwards)."""
    principal = request.app[AUTH].authenticate(request.headers.get("Authorization"))
    if roles:
        principal.require(*roles)
    job_id = checked_name(request.match_info["job"], "job id")
    bind(job_id=job_id, tenant=principal.tenant)
    return JobKeys(principal.tenant, job_id), principal


def job_keys(request: web.Request, *roles: str) -> JobKeys:
    return job_as(request, *roles)[0]
