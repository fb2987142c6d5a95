"""``smtp``: email through any SMTP server (aiosmtplib).

Operation ``send``; payload ``to`` (list), ``cc`` (list), ``subject``, ``text``,
optional ``html``, ``reply_to`` and ``from`` (only within the configured
``allowed_sender_domains``; default: ``sender``). The Message-ID is derived from the
idempotency key, so every attempt of a step carries the same one and receiving
systems (and auditors) can spot a duplicate; ``X-Fencegate-Key`` and
``X-Fencegate-Generation`` headers are added too.

Header values with CR/LF — raw, RFC 2047-encoded or percent-encoded — are
refused before anything is sent (400).

==================================================  ===============
what happened                                       outcome
==================================================  ===============
250 after DATA                                      Delivered
connection refused / timed out, TLS or login fail   NotDelivered
4xx to MAIL, RCPT or DATA                           NotDelivered
5xx to MAIL, RCPT or DATA                           Failed
connection lost or timeout after DATA was sent      Unknown
==================================================  ===============

SMTP does not deduplicate by Message-ID and cannot be asked what happened, so
an ``unknown`` email step stays unknown for an operator (never re-sent).
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from collections.abc import Mapping
from email.header import decode_header
from email.message import EmailMessage
from typing import Any, ClassVar, Literal

import aiosmtplib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adapters.base import (
    AdapterConfig,
    AdapterContext,
    Capabilities,
    Delivered,
    EffectRequest,
    Failed,
    InvalidPayload,
    NotDelivered,
    Outcome,
    Unknown,
    describe,
)

__all__ = ["SendPayload", "SmtpAdapter", "SmtpConfig", "message_id_for"]

_ADDRESS = re.compile(r"^[^@\s<>,;:\"()\[\]\\]+@[A-Za-z0-9.-]+$")


class SmtpConfig(AdapterConfig):
    type: Literal["smtp"] = "smtp"
    host: str
    port: int = Field(default=25, ge=1, le=65535)
    sender: str
    username_env: str = ""
    password_env: str = ""
    starttls: bool = False  # upgrade a plain connection (port 587)
    use_tls: bool = False  # implicit TLS (port 465)
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    message_id_domain: str = "fencegate.local"
    # A worker may set the payload's "from" to an address of one of these domains; empty:
    # every message goes out from `sender` and a "from" in the payload is refused.
    allowed_sender_domains: tuple[str, ...] = ()

    @field_validator("sender")
    @classmethod
    def _sender(cls, v: str) -> str:
        if not _ADDRESS.match(v):
            raise ValueError("sender must be a plain address like jobs@example.com")
        return v

    @field_validator("allowed_sender_domains")
    @classmethod
    def _domains(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for d in v:
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9-]+)*", d):
                raise ValueError(f"{d!r} is not a domain name like example.com")
        return v


def _has_line_break(value: str) -> bool:
    if "\r" in value or "\n" in value:
        return True
    if "%0a" in value.lower() or "%0d" in value.lower():
        return "\n" in urllib.parse.unquote(value) or "\r" in urllib.parse.unquote(value)
    if "=?" in value:  # RFC 2047 encoded words
        try:
            for chunk, charset in decode_header(value):
                text = (
                    chunk.decode(charset or "utf-8", "replace")
                    if isinstance(chunk, bytes)
                    else chunk
                )
                if "\r" in text or "\n" in text:
                    return True
        except Exception:
            return True
    return False


class SendPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    to: list[str] = Field(min_length=1, max_length=100)
    cc: list[str] = Field(default_factory=list, max_length=100)
    subject: str = Field(max_length=998)
    text: str = Field(max_length=1_000_000)
    html: str | None = Field(default=None, max_length=1_000_000)
    reply_to: str | None = None
    # the From address; only within the adapter's allowed_sender_domains
    sender: str | None = Field(default=None, alias="from")

    @field_validator("to", "cc")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        for addr in v:
            if _has_line_break(addr) or not _ADDRESS.match(addr):
                raise ValueError(f"{addr!r} is not a plain email address")
        return v

    @field_validator("reply_to", "sender")
    @classmethod
    def _reply_to(cls, v: str | None) -> str | None:
        if v is not None and (_has_line_break(v) or not _ADDRESS.match(v)):
            raise ValueError(f"{v!r} is not a plain email address")
        return v

    @field_validator("subject")
    @classmethod
    def _subject(cls, v: str) -> str:
        if _has_line_break(v):
            raise ValueError("subject must not contain line breaks (raw or encoded)")
        return v


def message_id_for(key: str, domain: str) -> str:
    """The same Message-ID for every attempt of one step."""
    return f"<fg.{hashlib.sha256(key.encode()).hexdigest()[:32]}@{domain}>"


class SmtpAdapter:
    Config: ClassVar[type[SmtpConfig]] = SmtpConfig

    def __init__(self, name: str, config: SmtpConfig, ctx: AdapterContext) -> None:
        self.name = name
        self._config = config
        self.capabilities = Capabilities(dedupes_by_key=False, lookup=False)
        self._username = (
            ctx.secret(config.username_env, f"adapters.{name}.username_env")
            if config.username_env
            else None
        )
        self._password = (
            ctx.secret(config.password_env, f"adapters.{name}.password_env")
            if config.password_env
            else None
        )

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        if operation != "send":
            raise InvalidPayload("the smtp adapter supports the operation 'send'")
        try:
            parsed = SendPayload.model_validate(dict(payload))
        except ValidationError as exc:
            raise InvalidPayload(describe(exc)) from exc
        if parsed.sender is not None:
            domain = parsed.sender.rpartition("@")[2].lower()
            allowed = [d.lower() for d in self._config.allowed_sender_domains]
            if domain not in allowed:
                raise InvalidPayload(
                    f"from: {parsed.sender!r} is not in this adapter's sender domains "
                    f"({', '.join(allowed) or f'none: it sends as {self._config.sender}'})"
                )

    def _message(self, request: EffectRequest, p: SendPayload) -> EmailMessage:
        msg = EmailMessage()
        msg["From"] = p.sender or self._config.sender
        msg["To"] = ", ".join(p.to)
        if p.cc:
            msg["Cc"] = ", ".join(p.cc)
        if p.reply_to:
            msg["Reply-To"] = p.reply_to
        msg["Subject"] = p.subject
        msg["Message-ID"] = message_id_for(request.idempotency_key, self._config.message_id_domain)
        msg["X-Fencegate-Key"] = request.idempotency_key
        msg["X-Fencegate-Generation"] = str(request.generation)
        msg.set_content(p.text)
        if p.html is not None:
            msg.add_alternative(p.html, subtype="html")
        return msg

    async def dispatch(self, request: EffectRequest) -> Outcome:
        payload = SendPayload.model_validate(dict(request.payload))
        msg = self._message(request, payload)
        budget = min(self._config.timeout_seconds, request.remaining())
        if budget <= 0:
            return NotDelivered("dispatch deadline passed before sending")
        cfg = self._config
        smtp = aiosmtplib.SMTP(
            hostname=cfg.host,
            port=cfg.port,
            timeout=budget,
            use_tls=cfg.use_tls,
            start_tls=cfg.starttls,
            username=self._username,
            password=self._password,
        )
        recipients = [*payload.to, *payload.cc]
        refused: dict[str, str] = {}
        worst = 0  # the most permanent RCPT refusal code seen
        phase = "connect"
        try:
            await smtp.connect()
            phase = "envelope"
            await smtp.mail(payload.sender or cfg.sender)
            for rcpt in recipients:
                try:
                    await smtp.rcpt(rcpt)
                except aiosmtplib.SMTPRecipientRefused as exc:
                    refused[rcpt] = f"{exc.code} {exc.message}"
                    worst = max(worst, exc.code)
            if len(refused) == len(recipients):
                return _classify_refusal(worst, {"refused": refused})
            phase = "data"  # from here on the message may have been accepted
            response = await smtp.data(msg.as_bytes())
        except aiosmtplib.SMTPAuthenticationError as exc:
            # bad credentials: a configuration problem, nothing was sent; retry after fixing it
            return NotDelivered(f"SMTP login refused ({exc.code}): check the credentials")
        except aiosmtplib.SMTPResponseException as exc:
            # The server answered with an error code: it did not take the message.
            return _classify_refusal(
                exc.code, {"code": exc.code, "message": exc.message, "phase": phase}
            )
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            if phase == "data":
                return Unknown(f"connection lost after DATA was sent: {type(exc).__name__}")
            return NotDelivered(f"SMTP {phase} failed: {type(exc).__name__}: {exc}")
        finally:
            if smtp.is_connected:
                try:
                    await smtp.quit()
                except (aiosmtplib.SMTPException, OSError, TimeoutError):
                    smtp.close()
        return Delivered(
            {
                "message_id": msg["Message-ID"],
                "accepted": [r for r in recipients if r not in refused],
                "refused": refused,
                "response": f"{response.code} {response.message}",
            }
        )

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        return None

    async def aclose(self) -> None:
        return None


def _classify_refusal(code: int, info: dict[str, Any]) -> Outcome:
    if 400 <= code < 500:
        return NotDelivered(f"SMTP server deferred ({code}): {info}")
    return Failed(info)
