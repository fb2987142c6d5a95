"""Role keys and tenants: ``Authorization: Bearer <key>`` → :class:`Principal`.

Keys are configured as SHA-256 digests (or read from an env var and digested
at start); a presented key is digested and compared in constant time with
every configured digest. With no keys configured the gateway is open, every
caller is ``admin`` of tenant ``default``, and it only serves on loopback.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.core.errors import Forbidden, Unauthorized
from gateway.runtime.settings import AuthKey

__all__ = ["OPEN", "Authenticator", "Principal"]


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
