"""Shared fixtures: transports to run on, and buffers with known contents."""

import os

import numpy as np
import pytest

import kvxfer


def _available(transport: str) -> str | None:
    """None when `transport` can make an agent here, else the reason it cannot."""
    try:
        kvxfer.Agent(f"probe-{transport}-{os.getpid()}", transport).shutdown()
    except kvxfer.NotAvailableError as e:
        return str(e)
    return None


TRANSPORTS = ["loopback", "ucx", "nixl"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    reason = _available(request.param)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


def pattern(n: int, seed: int) -> np.ndarray:
    """`n` pseudo-random bytes, reproducible from `seed`."""
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
