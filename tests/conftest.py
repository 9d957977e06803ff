import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def free_port():
    """A TCP port on loopback that was free a moment ago."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def python() -> str:
    return sys.executable
