"""Shared test fixtures: where the real-format fixtures live (../shared beside the checkout)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FORESHOCK_SHARED", REPO.parent / "shared"))
PROCFS_FIXTURE = SHARED / "fixtures" / "procfs"
XID_LINES = SHARED / "fixtures" / "kmsg" / "xid-lines.txt"
GOLDEN = REPO / "tests" / "golden"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    assert SHARED.is_dir(), f"../shared is missing beside the checkout ({SHARED}); set FORESHOCK_SHARED"
    return SHARED


@pytest.fixture(scope="session")
def procfs_fixture(shared_dir) -> Path:
    return PROCFS_FIXTURE


@pytest.fixture(scope="session")
def xid_lines(shared_dir) -> Path:
    return XID_LINES
