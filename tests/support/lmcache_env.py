"""Skips for tests that need LMCache or a Redis/Valkey server: one line locally, a failure
under CI (where scripts/setup.sh installs both, so a lost install cannot pass as a skip)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def require_lmcache() -> None:
    if importlib.util.find_spec("lmcache") is None:
        _missing(
            "needs LMCache (bash scripts/setup.sh installs it; pip install 'kakeyaturbo[lmcache]')"
        )


def require_redis() -> str:
    from lmcache_harness import redis_binary

    binary = redis_binary()
    if binary is None:
        _missing(
            "needs redis-server or valkey-server (bash scripts/setup.sh installs redis-server)"
        )
    return binary  # type: ignore[return-value]
