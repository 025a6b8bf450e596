"""The embedded server's lifecycle and guard rails, with real processes and real signals."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from store.redis.embedded import EmbeddedRedis
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]


def phaseline(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "actors.cli", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


SERVERS: list[psutil.Process] = []


def server_of(owner: subprocess.Popen[str]) -> psutil.Process:
    """The server child of a ``phaseline`` process, once it answers."""

    def found() -> psutil.Process | None:
        kids = [p for p in psutil.Process(owner.pid).children() if "server" in p.name()]
        return kids[0] if kids else None

    server = wait_until(found, what="the embedded server to start")
    SERVERS.append(server)
    return server


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "d"
    while SERVERS:  # a server a test left orphaned, on purpose or by failing
        server = SERVERS.pop()
        if server.is_running():
            server.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_server_stops_with_its_owner(data_dir: Path, sig: signal.Signals) -> None:
    """SIGTERM of ``phaseline redis`` orphaned redis-server."""
    owner = phaseline("redis", "--data-dir", str(data_dir))
    server = server_of(owner)
    wait_until(lambda: (data_dir / "url").exists() or None, what="the url file")
    owner.send_signal(sig)
    owner.wait(timeout=30)
    server.wait(timeout=30)  # psutil: raises TimeoutExpired if it outlived its owner
    assert not (data_dir / "url").exists()
    second = EmbeddedRedis(data_dir=data_dir)  # the lock is free again
    second.start()
    second.stop()


def test_a_server_that_outlived_a_sigkilled_owner_is_reused_never_doubled(data_dir: Path) -> None:
    owner = phaseline("redis", "--data-dir", str(data_dir))
    server = server_of(owner)
    wait_until(lambda: (data_dir / "url").exists() or None, what="the url file")
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(timeout=30)
    assert server.is_running()  # SIGKILL leaves no chance to stop it: it keeps the lock
    again = phaseline("redis", "--data-dir", str(data_dir))
    _, err = again.communicate(timeout=60)
    assert again.returncode == 1 and "in use by another embedded server" in err
    url = (data_dir / "url").read_text()
    assert "redis://:***@127.0.0.1" in err and url.split("@")[0] not in err  # no password shown
    cfg = data_dir.parent / "c.toml"
    cfg.write_text(f'[redis]\ndata_dir = "{data_dir}"\n')
    inspect = phaseline("inspect", "nothing", "--config", str(cfg))  # attaches to the survivor
    _, err = inspect.communicate(timeout=60)
    assert inspect.returncode == 1 and "RecordNotFound" in err, err
    assert (data_dir / "url").read_text() == url  # no second server took the directory
    assert server.is_running()


def test_the_server_wants_its_password_and_keeps_its_files_private(data_dir: Path) -> None:
    with EmbeddedRedis(data_dir=data_dir) as server:
        assert server.password and server.password in server.url
        assert server.port is not None
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.config_get("protected-mode")["protected-mode"] == "yes"
        client.close()
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        for path in data_dir.rglob("*"):
            if path.is_file():
                assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
        password = server.password
    with EmbeddedRedis(data_dir=data_dir) as again:  # the password is the directory's
        assert again.password == password


def test_a_run_that_started_the_server_stops_it_on_sigterm(data_dir: Path) -> None:
    cfg = data_dir.parent / "c.toml"
    cfg.write_text(f'[redis]\ndata_dir = "{data_dir}"\n')
    slow = data_dir.parent / "slow.toml"
    slow.write_text('name = "slow"\nrounds = 50\nllm_latency_ms = 200\n')
    owner = phaseline("run", "--in-process", "--scenario", str(slow), "--config", str(cfg))
    server = server_of(owner)
    wait_until(lambda: (data_dir / "url").exists() or None, what="the url file")
    owner.send_signal(signal.SIGTERM)
    owner.wait(timeout=30)
    server.wait(timeout=30)
    assert not (data_dir / "url").exists()


def test_a_power_loss_drops_the_tail_past_what_was_kept(data_dir: Path) -> None:
    # always: each write is in the file before its reply. Under everysec the server may hold a
    # write back while a background fsync runs (and still reply), so the tail could lag.
    with EmbeddedRedis(data_dir=data_dir, appendfsync="always") as server:
        client = redis.Redis.from_url(server.url)
        client.set("before", "1")
        kept = server.aof_tail()
        assert kept is not None
        client.set("after", "2")
        client.close()
        assert server.power_loss(kept) > 0
        client = redis.Redis.from_url(server.url)
        assert client.get("before") == b"1" and client.get("after") is None
        client.close()


def test_commands_find_the_same_embedded_server_from_any_directory(tmp_path: Path) -> None:
    """The user's embedded Redis is one place (``~/.local/state/phaseline/redis`` here, under
    a home of the test's), not ``./.phaseline`` of wherever a command runs."""
    home, here, there = tmp_path / "home", tmp_path / "a", tmp_path / "b"
    for d in (home, here, there):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PHASELINE_DATA_DIR", "XDG_STATE_HOME")}
    env |= {"HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "500"}

    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "actors.cli", *args], cwd=cwd, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip

    sent = run(here, "submit", "--agent", "tests.support.agents:recall", "--input", "hi",
               "--turn-id", "anywhere")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    where = home / ".local" / "state" / "phaseline" / "redis"
    assert f"(data in {where})" in sent.stderr
    seen = run(there, "inspect", "anywhere", "--json")
    assert seen.returncode == 0, seen.stderr
    assert '"turn_id": "anywhere"' in seen.stdout
    assert not (here / ".phaseline").exists() and not (there / ".phaseline").exists()
