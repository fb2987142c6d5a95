"""Pure: parse, sign and verify fencing tokens presented in the ``Fencing-Token`` header.

Unsigned mode: the decimal generation, ``1 <= g <= 2**53 - 1``, no sign, no
leading zeros, no spaces. Anything else is :class:`~gateway.core.errors.InvalidRequest`.

Signed mode (``auth.token_signing_key_env`` set): ``v1.<gen>.<exp>.<sig>`` with
``sig = base64url(HMAC-SHA256(key, "<tenant>/<job_id>.<gen>.<exp>"))`` without
padding, in its one canonical spelling (no leading zeros, no sign, no spaces).
Forged, expired, unsigned, other-job, other-tenant and non-canonical tokens are
:class:`~gateway.core.errors.BadToken`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

from gateway.core.errors import BadToken, InvalidRequest

__all__ = [
    "MAX_GENERATION",
    "TokenSigner",
    "parse_generation",
    "parse_unsigned_token",
    "sign_token",
]

MAX_GENERATION = 2**53 - 1
_DECIMAL = re.compile(r"[1-9][0-9]{0,15}")


def parse_generation(value: object, what: str = "generation") -> int:
    """Validate a JSON generation: an integer (not a bool, not a float) in range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{what} must be an integer from 1 to 2^53-1")
    if not 1 <= value <= MAX_GENERATION:
        raise InvalidRequest(f"{what} must be an integer from 1 to 2^53-1, got {value}")
    return value


def parse_unsigned_token(token: str | None) -> int:
    """The generation of an unsigned token (the decimal string)."""
    if token is None or token == "":
        raise InvalidRequest("the Fencing-Token header is required")
    if not _DECIMAL.fullmatch(token):
        raise InvalidRequest("Fencing-Token must be a decimal generation from 1 to 2^53-1")
    gen = int(token)
    if gen > MAX_GENERATION:
        raise InvalidRequest("Fencing-Token must be a decimal generation from 1 to 2^53-1")
    return gen


# -- signed tokens (docs/security.md) ------------------------------------------

# canonical only: decimals without leading zeros, no sign, no spaces; the signature is
# unpadded base64url of 32 bytes (43 characters, the last one's two spare bits zero)
_SIGNED = re.compile(
    r"v1\.([1-9][0-9]{0,15})\.([1-9][0-9]{0,11})\.([A-Za-z0-9_-]{42}[AEIMQUYcgkosw048])"
)


def _signature(key: bytes, tenant: str, job_id: str, generation: int, expires_at: int) -> str:
    message = f"{tenant}/{job_id}.{generation}.{expires_at}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def sign_token(key: bytes, tenant: str, job_id: str, generation: int, expires_at: int) -> str:
    """``v1.<gen>.<exp>.<sig>``; an external scheduler can mint these with the same key."""
    parse_generation(generation)
    return f"v1.{generation}.{expires_at}.{_signature(key, tenant, job_id, generation, expires_at)}"


class TokenSigner:
    """Signs with the first key, verifies with any (key rotation)."""

    def __init__(self, keys: list[bytes], ttl_seconds: int) -> None:
        if not keys or any(len(k) < 32 for k in keys):
            raise ValueError("token signing keys must be at least 32 bytes each")
        self._keys = keys
        self.ttl_seconds = ttl_seconds

    def sign(self, tenant: str, job_id: str, generation: int, now: float | None = None) -> str:
        expires_at = int((time.time() if now is None else now) + self.ttl_seconds)
        return sign_token(self._keys[0], tenant, job_id, generation, expires_at)

    def verify(self, token: str | None, tenant: str, job_id: str, now: float | None = None) -> int:
        """The generation of a valid token, else BadToken (``presented`` set if readable)."""
        if not token:
            raise InvalidRequest("the Fencing-Token header is required")
        m = _SIGNED.fullmatch(token)
        if m is None:
            presented = (
                int(token) if _DECIMAL.fullmatch(token) and int(token) <= MAX_GENERATION else None
            )
            raise BadToken(
                "signed tokens are required: v1.<generation>.<expires>.<signature>",
                presented=presented,
            )
        generation, expires_at, sig = int(m.group(1)), int(m.group(2)), m.group(3)
        if generation > MAX_GENERATION:
            raise BadToken("generation out of range", presented=None)
        expected = [_signature(k, tenant, job_id, generation, expires_at) for k in self._keys]
        if not any(hmac.compare_digest(sig, e) for e in expected):
            raise BadToken(
                "token signature is not valid for this tenant and job", presented=generation
            )
        if expires_at <= (time.time() if now is None else now):
            raise BadToken("token expired", presented=generation)
        return generation
