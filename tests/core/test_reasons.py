"""The audit vocabulary (gateway.core.reasons) holds every reason anything can write.

Every Lua script's audit entries are read here: a literal ``'reason', '…'``, a ``reject('…')``
(or any local function that passes its parameter on as the reason: each call site's
argument), a literal prefix (``'operator_resolved_' .. ARGV[1]``). Reasons decided in Python
are the codes of the errors the gateway audits itself (a bad token, a quota).
"""

from __future__ import annotations

import re

import pytest

from gateway.core.errors import BadToken, QuotaExceeded
from gateway.core.reasons import REASONS, REFUSALS, RESOLUTIONS, resolution
from gateway.store.scripts import SCRIPT_NAMES, lua_source

pytestmark = pytest.mark.fast


def _scripts() -> list[tuple[str, str]]:
    """Every script as Redis runs it: the prelude and its includes resolved."""
    return [(f"{name}.lua", lua_source(name)) for name in SCRIPT_NAMES]


_REASON_FIELD = re.compile(r"'reason',\s*('([a-z_]+)'(\s*\.\.)?|ARGV\[\d+\]|([A-Za-z_]\w*))")


def _arguments(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose ``(`` is at ``start``."""
    args, depth, quote, current = [], 0, "", ""
    for ch in text[start + 1 :]:
        if quote:
            current += ch
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "({":
            depth += 1
        elif ch in ")}":
            if depth == 0:
                args.append(current.strip())
                return args
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
            continue
        current += ch
    raise AssertionError("unbalanced call")


def _written(text: str) -> tuple[set[str], set[str], int]:
    """(reasons, prefixes, reasons taken from ARGV) that one script can write."""
    reasons: set[str] = set()
    prefixes: set[str] = set()
    from_argv = 0
    for m in _REASON_FIELD.finditer(text):
        if m[2] is not None:
            (prefixes if m[3] else reasons).add(m[2])
        elif m[4] is not None:  # a parameter: find its function and every call of it
            param = m[4]
            defs = [
                d
                for d in re.finditer(r"local function (\w+)\(([^)]*)\)", text[: m.start()])
                if param in [p.strip() for p in d[2].split(",")]
            ]
            assert defs, f"{param!r} is no parameter of an enclosing local function"
            name, params = defs[-1][1], [p.strip() for p in defs[-1][2].split(",")]
            if name == "reject_call":  # includes/reject: its callers are reject() / g.reject()
                reasons.update(re.findall(r"(?<![\w])(?:g\.)?reject\('([a-z_]+)'", text))
                for call in re.finditer(r"(?<![\w.])reject_call\(", text):
                    arg = _arguments(text, call.end() - 1)[1]
                    if literal := re.fullmatch(r"'([a-z_]+)'", arg):
                        reasons.add(literal[1])
                    elif arg.startswith("ARGV["):
                        from_argv += 1
                    elif arg != "reason":  # g.reject's own pass-through
                        raise AssertionError(f"reject_call passes a non-literal reason: {arg}")
                continue
            position = params.index(param)
            calls = [
                c for c in re.finditer(rf"(?<![\w.]){name}\(", text) if c.start() > defs[-1].end()
            ]
            assert calls, f"{name} is never called"
            for call in calls:
                args = _arguments(text, call.end() - 1)
                if position >= len(args):
                    continue  # not passed: nil, no audit entry with a reason
                literal = re.fullmatch(r"'([a-z_]+)'", args[position])
                assert literal, f"{name}(...) passes a reason that is not a literal: {args}"
                reasons.add(literal[1])
        else:
            from_argv += 1
    return reasons, prefixes, from_argv


def test_every_reason_a_script_can_write_is_in_the_vocabulary() -> None:
    found: dict[str, set[str]] = {}
    for name, text in _scripts():
        reasons, prefixes, from_argv = _written(text)
        for r in reasons:
            found.setdefault(r, set()).add(name)
        for p in prefixes:
            assert any(r.startswith(p) for r in REASONS), f"{name}: {p}…"
        if from_argv:  # reject-2: the code of an error decided in Python (a bad token)
            assert name == "reject-2.lua", name
    missing = {r: sorted(f) for r, f in found.items() if r not in REASONS}
    assert missing == {}, f"reasons the scripts write that the vocabulary lacks: {missing}"
    # the scan sees the scripts' real reasons (a broken scan would find nothing)
    for expected in ("stale_generation", "job_cancelled", "superseded", "lease_expired"):
        assert expected in found, sorted(found)


def test_the_vocabulary_holds_what_python_audits_and_nothing_unwritten() -> None:
    assert BadToken.code in REFUSALS and QuotaExceeded.code in REFUSALS
    assert {resolution(True), resolution(False)} == set(RESOLUTIONS)
    for stale in ("future_generation", "unregistered", "cancelled"):
        assert stale not in REASONS
    written: set[str] = {BadToken.code, QuotaExceeded.code, *RESOLUTIONS}
    for _, text in _scripts():
        written |= _written(text)[0]
    assert set(REASONS) == written, set(REASONS) ^ written
