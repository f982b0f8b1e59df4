"""A throwaway ``redis-server`` for the tests of the shared history store.

``RedisServer`` starts Debian's ``redis-server`` on a free loopback port in a temporary
directory, with persistence off (``--save ''``, ``--appendonly no``), and stops it; tests skip
with the reason when ``redis-server`` is not on PATH (``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``url`` names it. ``stop`` ends it (and is idempotent)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
        for _ in range(3):      # another process may take the free port before the server does
            self.port = _free_port()
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(workdir), "--logfile", ""],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return
            self.stop()
        raise RuntimeError("redis-server did not start on a free port in three tries")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 60.0) -> bool:
        """PONG within ``timeout_s`` (a hang guard for a slow, busy machine, not a verdict: a
        server that lost its port exits, and that ends the wait at once)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5.0) as s:
            s.sendall(b"FLUSHALL\r\n")
            assert s.recv(16).startswith(b"+OK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
