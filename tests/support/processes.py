"""The CLI and Ray's own ``ray start`` in processes of their own, as a user starts them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PHASELINE = str(BIN / "phaseline")


def spawn_run(
    url: str, namespace: str, agent: str, message: str, *, turns: int, run_id: str
) -> subprocess.Popen[bytes]:
    """``phaseline run --in-process`` of ``turns`` turns of ``agent`` in a process of its own
    (for a test to SIGKILL while they run); its stderr is kept for a failed assertion."""
    return subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "run", "--in-process", "--redis-url", url,
         "--namespace", namespace, "--config", str(ROOT / "configs" / "test.toml"),
         "--agent", agent, "--input", message, "--turns", str(turns), "--run-id", run_id],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def token_home(home: Path) -> dict[str, str]:
    """An environment whose home (``home``, made here) holds a Ray token, as a machine that
    ran Ray once has, and none of the test process's Ray variables."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True,
        capture_output=True,
    )  # fmt: skip
    if not (home / ".ray" / "auth_token").read_text().strip():
        raise RuntimeError("ray get-auth-token --generate wrote no token")
    return env


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def phaseline(
    *args: str, until: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Run the CLI in its own process (a client as a user starts one): exit status and what it
    printed (both streams); with ``until``, send it SIGINT once that text is printed."""
    proc = await asyncio.create_subprocess_exec(
        PHASELINE, *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**(env or os.environ), "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(180):
        while line := (await proc.stdout.readline()).decode():
            seen.append(line)
            if until is not None and until in line:
                proc.send_signal(signal.SIGINT)
                until = None
        return await proc.wait(), "".join(seen)


def ray_start(*args: str, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``ray start ... --block`` (a node of a cluster made as users make them), returned once
    it says its node runs; SIGTERM stops the node and every process of it."""
    sink = log.open("wb")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", *args, "--disable-usage-stats", "--block"],
        cwd=ROOT, env=dict(env), stdout=sink, stderr=subprocess.STDOUT,
    )  # fmt: skip
    sink.close()
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"ray start {args} did not start:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.25)  # the poll period: returns at once if it exits
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
