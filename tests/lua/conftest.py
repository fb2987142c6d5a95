"""The Lua tests' fixtures: every script loaded into the session's (flushed) Redis."""

from __future__ import annotations

import pytest
import redis

from tests.lua.scripts import JOB, Scripts


@pytest.fixture
def lua(redis_sync: redis.Redis) -> Scripts:
    return Scripts(redis_sync)


@pytest.fixture
def job_registered(lua: Scripts) -> None:
    """:data:`JOB` registered at generation 1 (``pytest.mark.usefixtures("job_registered")``)."""
    lua.register(JOB, 1)
