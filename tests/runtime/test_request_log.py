"""One canonical log line per request; rejections log both generations; no secrets."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from gateway.runtime.logging import redactor
from tests.conftest import Gateway


async def test_canonical_request_lines(gw: Gateway) -> None:
    await gw.register("r", generation=2)
    with capture_logs() as logs:
        await gw.effect("r", "notify", 2, worker_id="worker-b")
        await gw.effect("r", "notify", 1, worker_id="worker-a")
    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 2
    ok, stale = lines
    assert ok["status"] == 200 and ok["outcome"] == "succeeded"
    assert (ok["job_id"], ok["step"], ok["generation"], ok["worker_id"]) == (
        "r",
        "notify",
        2,
        "worker-b",
    )
    assert stale["status"] == 409 and stale["outcome"] == "stale_generation"
    assert (stale["presented"], stale["current"], stale["worker_id"]) == (1, 2, "worker-a")
    assert ok["request_id"] != stale["request_id"]


def test_redactor_blanks_secrets_and_sensitive_keys() -> None:
    redact: Any = redactor(["s3cr3t-value"])
    event = redact(
        None,
        "info",
        {"event": "x", "detail": "token s3cr3t-value leaked", "authorization": "Bearer abc"},
    )
    assert event == {
        "event": "x",
        "detail": "token [redacted] leaked",
        "authorization": "[redacted]",
    }


async def test_request_log_problems_only(make_gateway: Any) -> None:
    """server.request_log = "problems": no line for successes; rejections keep theirs."""
    gw: Gateway = await make_gateway(server={"request_log": "problems"})
    await gw.register("r", generation=2)
    with capture_logs() as logs:
        assert (await gw.effect("r", "notify", 2)).status == 200
        assert (await gw.effect("r", "notify", 1)).status == 409
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["status"], e["presented"], e["current"]) for e in lines] == [(409, 1, 2)]


_PARITY = """
import structlog
from gateway.runtime.logging import configure_logging, log_request
configure_logging(json=True, secrets=["s3cr3t-value"])
class Opaque:  # not JSON: the renderer's fallback handler must turn it into its repr
    def __repr__(self): return "<opaque>"
structlog.contextvars.bind_contextvars(bound_by_adapter="yes", opaque=Opaque())
fields = {"request_id": "r1", "job_id": "j", "worker_id": "w s3cr3t-value", "generation": 2,
          "presented": None, "method": "POST", "path": "/v1/jobs/j/fence", "status": 409, "ms": 0.5,
          "authorization": "Bearer x"}
log_request(dict(fields))
structlog.get_logger("fencegate").info("request", **fields)
"""


def test_request_line_fast_path_renders_what_structlog_renders() -> None:
    """The canonical line skips structlog's wrapper for speed; its output must not change."""
    import subprocess
    import sys

    import orjson

    run = subprocess.run(
        [sys.executable, "-c", _PARITY], capture_output=True, check=True, timeout=60
    )
    fast, reference = (orjson.loads(line) for line in run.stderr.splitlines())
    assert list(fast) == list(reference)  # same keys, same order
    assert fast.pop("timestamp").endswith("Z") and reference.pop("timestamp").endswith("Z")
    assert fast == reference
    assert fast["worker_id"] == "w [redacted]" and fast["authorization"] == "[redacted]"
    assert fast["bound_by_adapter"] == "yes" and fast["level"] == "info"
    assert fast["opaque"] == "<opaque>"


_BUFFERED = r"""
import asyncio, sys
from gateway.runtime.logging import configure_logging, log_request
import structlog

configure_logging(json=True)
log = structlog.get_logger("t")

async def main():
    for i in range(500):
        log_request({"n": i})
    log.error("an_error_after_500_requests")  # written at once, after what was buffered
    for i in range(500, 700):
        log_request({"n": i})
    # no flush: the process ends here, the buffer goes out at exit

asyncio.run(main())
"""


def test_request_lines_are_buffered_in_order_and_none_is_lost_at_exit() -> None:
    """Request lines are written in batches, off the request path; an error line goes out at
    once and after every request line logged before it; the last batch is written at exit."""
    import subprocess
    import sys

    import orjson

    run = subprocess.run(
        [sys.executable, "-c", _BUFFERED], capture_output=True, check=True, timeout=60
    )
    lines = [orjson.loads(line) for line in run.stderr.splitlines()]
    requests = [e["n"] for e in lines if e["event"] == "request"]
    assert requests == list(range(700))
    error_at = next(i for i, e in enumerate(lines) if e["event"] == "an_error_after_500_requests")
    assert error_at == 500


_BATCH = r"""
import asyncio, structlog
from gateway.runtime.logging import configure_logging, log_info_lines
configure_logging(json=True, secrets=["s3cr3t-value"])
anchors = [{"v": 1, "job_id": f"j{i}", "head": "h s3cr3t-value", "count": i} for i in range(3)]

async def main():
    log_info_lines("audit_anchor", [dict(a) for a in anchors])
    structlog.get_logger("fencegate.audit").info("audit_anchor", **anchors[0])
    # no flush: the batch is buffered, written before that line and at exit

asyncio.run(main())
"""


def test_info_line_batches_render_what_structlog_renders_in_order() -> None:
    """A periodic task's batch (the audit anchors of one tick) is buffered like the request
    lines and renders what structlog renders, redaction included; nothing is lost at exit."""
    import subprocess
    import sys

    import orjson

    run = subprocess.run(
        [sys.executable, "-c", _BATCH], capture_output=True, check=True, timeout=60
    )
    lines = [orjson.loads(line) for line in run.stderr.splitlines()]
    assert [e["job_id"] for e in lines] == ["j0", "j1", "j2", "j0"]
    fast, reference = lines[0], lines[3]
    assert list(fast) == list(reference)  # same keys, same order
    assert fast.pop("timestamp").endswith("Z") and reference.pop("timestamp").endswith("Z")
    assert fast == reference
    assert fast["event"] == "audit_anchor" and fast["head"] == "h [redacted]"
