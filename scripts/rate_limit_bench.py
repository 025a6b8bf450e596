"""A burst of turns against an endpoint that limits the way providers do: the rate-limit figure.

200 concurrent turns of a 2-round tool agent (3 model calls each, 600 requests) against the scripted
OpenAI-compatible endpoint (``actors.harness.model_endpoint``) limited to 600 requests a minute with
a burst of 100 (over it: 429 with ``retry-after``, ``retry-after-ms`` and ``x-ratelimit-*``), each
accepted call answered after a latency drawn around the row's (0, 200 ms, 2 s; +-50 %, as a
provider's generation times vary) and each refusal after the row's latency up to 200 ms (a
provider's gateway refuses before any generation: a far one's round trip;
``--refusal-latency-cap-ms`` raises the cap, to see refusals as old as the replies). Each variant is
one ``phaseline run`` (in process, and on a local Ray with 2 hosts), with the limit undeclared
(``actors.harness.http_agents:http_json``) and declared
(``actors.harness.http_agents:http_limited_bench``). Reported per variant: outcomes, wall time
against the ideal (requests beyond the burst divided by the rate, 50 s, plus the last call's
latency), the endpoint's accepted and refused requests; then the rows as a Markdown table.

Run from a checkout: ``.venv/bin/python scripts/rate_limit_bench.py [--turns 200]
[--latencies 0,200,2000] [--tree DIR] [--only in_process] [--report FILE]``; ``--tree`` runs
another checkout's ``phaseline`` (the same command before and after a change).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RPM, BURST, ROUNDS = 600, 100, 2
#: Each accepted call's latency is drawn uniformly within this fraction around the row's.
SPREAD = 0.5
AGENTS = {
    "undeclared": "actors.harness.http_agents:http_json",
    "declared": "actors.harness.http_agents:http_limited_bench",
}
MODES = {"in_process": ["--in-process"], "ray_2_hosts": ["--hosts", "2"]}


def _call(url: str, body: dict[str, object] | None = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=10) as reply:
        return dict(json.loads(reply.read()))


def run_variant(
    tree: Path,
    base: str,
    mode: str,
    agent: str,
    turns: int,
    latency_ms: int,
    refusal_cap_ms: int,
) -> dict[str, object]:
    refusal_ms = min(latency_ms, refusal_cap_ms)
    limit = {"rpm": RPM, "burst": BURST, "headers": True, "refusal_latency_ms": refusal_ms}
    _call(f"{base}/_limit", limit)  # a full bucket
    script = {
        "rounds": ROUNDS,
        "tool": "add",
        "quote": False,
        "latency_ms": latency_ms,
        "latency_spread": SPREAD,
    }
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "run.json"
        cmd = [
            sys.executable,
            "-m",
            "actors.cli",
            "run",
            "--namespace",
            f"rl{int(time.time())}",
            "--agent",
            agent,
            "--input",
            f"#script {json.dumps(script)}\nAdd, please.",
            "--turns",
            str(turns),
            "--report",
            str(report),
            *MODES[mode],
        ]
        env = {
            **os.environ,
            "OPENAI_BASE_URL": f"{base}/v1",
            "PHASELINE_TEST_OPENAI_KEY": "k",
            "PYTHONPATH": str(tree),
            "RAY_TMPDIR": tempfile.mkdtemp(prefix="rb", dir="/tmp"),
        }
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        data = json.loads(report.read_text()) if report.exists() else {}
    seen = _call(f"{base}/_stats")
    requests = turns * (ROUNDS + 1)
    ideal = max(0, requests - BURST) / (RPM / 60) + latency_ms / 1000
    accepted, refused = int(seen["accepted"]), int(seen["refused"])  # type: ignore[call-overload]
    return {
        "exit": done.returncode,
        "outcomes": data.get("outcomes"),
        "run_wall_s": data.get("wall_s"),
        "command_wall_s": round(wall, 1),
        "latency_ms": latency_ms,
        "refusal_latency_ms": refusal_ms,
        "ideal_s": ideal,
        "wall_over_ideal": round(float(data["wall_s"]) / ideal, 2) if data and ideal else None,
        "accepted": accepted,
        "refused": refused,
        "refused_per_accepted": round(refused / accepted, 3) if accepted else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--only", choices=sorted(MODES), default=None)
    parser.add_argument("--agents", default=",".join(AGENTS))
    parser.add_argument("--latencies", default="0,200,2000", help="ms per call, one row each")
    parser.add_argument(
        "--refusal-latency-cap-ms",
        type=int,
        default=200,
        help="a refusal comes after the row's latency, at most this",
    )
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = subprocess.Popen(
        [sys.executable, "-m", "actors.harness.model_endpoint", str(port)], cwd=ROOT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                _call(f"{base}/_stats")
                break
            except OSError:
                time.sleep(0.05)  # waiting for the endpoint to listen
        figures: dict[str, object] = {
            "tree": str(args.tree),
            "turns": args.turns,
            "rpm": RPM,
            "burst": BURST,
        }
        for mode in [args.only] if args.only else list(MODES):
            for name in args.agents.split(","):
                for latency in (int(ms) for ms in args.latencies.split(",")):
                    figures[f"{mode}/{name}/{latency}ms"] = fig = run_variant(
                        args.tree,
                        base,
                        mode,
                        AGENTS[name],
                        args.turns,
                        latency,
                        args.refusal_latency_cap_ms,
                    )
                    print(f"{mode}/{name}/{latency}ms: {json.dumps(fig)}", flush=True)
    finally:
        endpoint.terminate()
    if args.report:
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    print(table(figures))


def table(figures: dict[str, object]) -> str:
    """The rows as docs/BENCHMARKS.md shows them."""
    lines = [
        "| where | limit | latency (refusals) | outcomes | wall | ideal | wall / ideal "
        "| refused / accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, fig in figures.items():
        if not isinstance(fig, dict):
            continue
        mode, limit, _ = key.split("/")
        where = "in process" if mode == "in_process" else "Ray, 2 hosts"
        outcomes = ", ".join(f"{n} {o}" for o, n in (fig["outcomes"] or {}).items())
        lines.append(
            f"| {where} | {limit} | {fig['latency_ms']} ms ({fig['refusal_latency_ms']} ms) "
            f"| {outcomes} (exit {fig['exit']}) "
            f"| {fig['run_wall_s']} s | {fig['ideal_s']:.1f} s | {fig['wall_over_ideal']} "
            f"| {fig['refused']} / {fig['accepted']} ({fig['refused_per_accepted']}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
