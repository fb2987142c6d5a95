"""Who is looking: the console's login cookie, CSRF tokens, the proof of login, and the
secret that signs them.

A login takes an API key of role ``auditor`` or ``admin`` and sets one cookie: under TLS
``__Host-fg_console`` (``Secure``, ``Path=/``, no ``Domain``: only this host name over
HTTPS can set or receive it), else ``fg_console`` (``Path=/console``); both ``HttpOnly``,
``SameSite=Strict``. Its value is ``<payload>.<mac>``, both base64url, the payload a small
JSON object

    {"t": tenant, "r": role, "n": key name, "k": key id, "e": expiry (s), "s": session id}

and the MAC HMAC-SHA256(console secret, payload). Any worker or gateway holding the same
secret accepts it (``--workers N``). ``k`` is a MAC of the key's digest, not the key or its
digest: a key removed from the configuration ends its logins at the next request. A logout
is recorded in Redis under the session id (gateway.store.consolestate), so the cookie stops
working at once everywhere.

Three values derive from the session id, each HMAC(secret, label + id):

* the **CSRF token**, in every form of every page: a page of another site can neither read
  it nor compute it;
* the **proof of login**, given to the browser once, in the fragment of the login's
  redirect (``#fg-proof=…``: never sent to a server, never in a page), and kept by the
  console's script in this origin's ``localStorage``, which a page on another port or host
  cannot read. Every state-changing form (resolve, verify) must carry it, or the session's
  own API key typed again. Browsers send cookies to every port of a host, so a service on
  another port can receive the cookie and replay it with any headers, read pages and their
  CSRF tokens; without the proof it still cannot change anything.

The secret: ``[console] secret_env`` when set; else a random secret kept in
``<redis.data_dir>/console.secret`` (created once, atomically, mode 0600; shared by the
workers and gateways of one data dir). It is never derived from API keys, token signing
keys or audit keys: whoever holds one of those (a worker, an external scheduler) could
otherwise sign a cookie for any key of any tenant.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.runtime.settings import Settings

__all__ = ["COOKIE", "HOST_COOKIE", "Keys", "Session", "Sessions", "console_secret", "cookie_name"]

COOKIE = "fg_console"
HOST_COOKIE = "__Host-fg_console"  # under TLS
LOGIN_ROLES = ("auditor", "admin")
_SECRET_FILE = "console.secret"


class Keys(Protocol):
    """The gateway's API keys (``gateway.http.auth.Authenticator``), as the console uses them."""

    @property
    def open(self) -> bool: ...

    def authenticate(self, header: str | None) -> Any: ...

    def entries(self) -> tuple[tuple[bytes, Any], ...]: ...


def cookie_name(secure: bool) -> str:
    """The cookie's name: ``__Host-`` prefixed over TLS (browsers then require ``Secure``,
    ``Path=/`` and no ``Domain``)."""
    return HOST_COOKIE if secure else COOKIE


def console_secret(settings: Settings, secret: Callable[[str, str], str]) -> bytes:
    """The key that signs console cookies, CSRF tokens and proofs (see the module docstring)."""
    if settings.console.secret_env:
        material = secret(settings.console.secret_env, "console.secret_env")
    else:
        material = _file_secret(Path(settings.redis.data_dir) / _SECRET_FILE)
    return hmac.new(b"fencegate console v1", material.encode(), hashlib.sha256).digest()


def _file_secret(path: Path) -> str:
    """Read the data dir's console secret, creating it once (write a temporary file, then
    link it into place: a worker racing this one reads either nothing or the whole file)."""
    with contextlib.suppress(FileNotFoundError):
        return path.read_text(encoding="ascii").strip()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_urlsafe(32).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another worker was first: use its secret
    finally:
        tmp.unlink()
    return path.read_text(encoding="ascii").strip()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    """A console login: whose tenant, which role, which key (by name)."""

    tenant: str
    role: str
    name: str
    expires: int
    nonce: str  # the session id
    open: bool = False  # no keys configured: loopback only, nobody logs in
    kid: str = ""  # the key id of the login's key

    @property
    def who(self) -> str:
        """How an action of this session is recorded: the key's name, else its role (as the
        API records it)."""
        return self.name or self.role


class Sessions:
    """Issues and checks console cookies and CSRF tokens."""

    def __init__(self, secret: bytes, auth: Keys, ttl_seconds: int) -> None:
        self._secret = secret
        self._auth = auth
        self.ttl = ttl_seconds
        # key id (a MAC of the key's digest) → principal, for the keys configured now
        self._keys = {self._kid(d): p for d, p in auth.entries()}

    @property
    def open(self) -> bool:
        return self._auth.open

    def _kid(self, digest: bytes) -> str:
        return _b64(hmac.new(self._secret, b"key" + digest, hashlib.sha256).digest()[:12])

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._secret, data, hashlib.sha256).digest()

    def open_session(self) -> Session:
        return Session("default", "admin", "", 0, "open", open=True)

    def login(self, key: str) -> tuple[Session, str] | None:
        """A session and its cookie value for an auditor or admin key; None for any other."""
        try:
            principal = self._auth.authenticate(f"Bearer {key}")
        except Exception:  # Unauthorized: unknown key (the same answer for every failure)
            return None
        if principal.role not in LOGIN_ROLES:
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        session = Session(
            tenant=principal.tenant,
            role=principal.role,
            name=str(getattr(principal, "name", "") or ""),
            expires=int(time.time()) + self.ttl,
            nonce=secrets.token_urlsafe(16),
            kid=self._kid(digest),
        )
        body = {
            "t": session.tenant,
            "r": session.role,
            "n": session.name,
            "k": session.kid,
            "e": session.expires,
            "s": session.nonce,
        }
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return session, f"{payload}.{_b64(self._mac(payload.encode()))}"

    def check(self, cookie: str | None) -> Session | None:
        """The session of a cookie that is well-formed, signed here, unexpired and names a key
        that is still configured with the same role and tenant; else None."""
        if not cookie or len(cookie) > 1024 or cookie.count(".") != 1:
            return None
        payload, mac = cookie.split(".")
        try:
            if not hmac.compare_digest(_unb64(mac), self._mac(payload.encode())):
                return None
            body = json.loads(_unb64(payload))
        except (ValueError, UnicodeError):
            return None
        if not isinstance(body, dict):
            return None
        principal = self._keys.get(str(body.get("k")))
        expires = body.get("e")
        if (
            principal is None
            or not isinstance(expires, int)
            or expires <= time.time()
            or body.get("t") != principal.tenant
            or body.get("r") != principal.role
            or principal.role not in LOGIN_ROLES
        ):
            return None
        name = str(getattr(principal, "name", "") or "")  # the key's name as configured now
        nonce = body.get("s")
        if not isinstance(nonce, str) or not nonce:
            return None
        return Session(
            principal.tenant, principal.role, name, expires, nonce, kid=str(body.get("k"))
        )

    def csrf(self, session: Session) -> str:
        return _b64(self._mac(b"csrf" + session.nonce.encode()))

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(str(token), self.csrf(session))

    def proof(self, session: Session) -> str:
        """The proof of login: given to the browser once, at login (never in a page)."""
        return _b64(self._mac(b"proof" + session.nonce.encode()))

    def proven(self, session: Session, proof: str | None, key: str | None) -> bool:
        """Does a state-changing form come from the browser that logged in: it carries the
        session's proof, or the session's own API key typed again? (Open mode: no login,
        nothing to prove.)"""
        if session.open:
            return True
        if proof and hmac.compare_digest(str(proof), self.proof(session)):
            return True
        if not key:
            return False
        digest = hashlib.sha256(str(key).strip().encode()).digest()
        return hmac.compare_digest(self._kid(digest), session.kid) and (
            self._keys.get(session.kid) is not None
        )
