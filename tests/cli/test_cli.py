"""The CLI boundary: clear typed errors and exit status for bad input; run and inspect work."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from actors.cli import main
from actors.cli.app import count
from actors.cli.runs import _exit_unless_final
from actors.engine.models.scenario import load_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.run_stats import RunStats
from actors.engine.turn_engine import TurnEngine
from actors.turn.run_result import TurnOutcome
from bus.outcomes import Outcome
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.urls import check_redis_url, redact_url, seed_urls

ROOT = Path(__file__).resolve().parents[2]
PLAIN = str(ROOT / "configs" / "scenarios" / "tool_loop.toml")
TEST_CONFIG = str(ROOT / "configs" / "test.toml")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def test_every_shipped_scenario_and_config_is_valid() -> None:
    from actors.engine.models.scenario import load_scenario
    from actors.engine.settings.config import load_settings
    from actors.engine.tools.builtin_tools import BUILTIN_TOOLS

    scenarios = sorted((ROOT / "configs" / "scenarios").glob("*.toml"))
    assert len(scenarios) >= 5
    for path in scenarios:
        BUILTIN_TOOLS.require(load_scenario(path).tools)
    for path in sorted((ROOT / "configs").glob("*.toml")):
        load_settings(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            'name = "x"\nroundz = 3\n',
            "roundz: Extra inputs are not permitted (did you mean 'rounds'?)",
        ),
        ("rounds = 3\n", "name"),
        ('name = "x"\nrounds = -1\n', "rounds"),
        ('name = "x"\n[[faults]]\nat_call = 1\nkind = "explode"\n', "kind"),
        ('name = "x"\ntools = ["nope"]\n', "unknown tools ['nope']"),
        ('name = "x\n', "not valid TOML"),
        # within each field's limit, but 10 GB a round
        ('name = "x"\ntools_per_round = 1000\npayload_bytes = 10000000\n', "a round would"),
        ('name = "x"\nrounds = 10000\npayload_bytes = 100000\n', "transcript would grow"),
        ('name = "x"\nrounds = true\n', "rounds: Input should be a valid integer"),
        ('name = "x"\n[[faults]]\nat_call = 1.0\nkind = "empty"\n', "faults.0.at_call"),
    ],
)
def test_bad_scenarios_are_refused_with_exit_2(
    tmp_path: Path, redis_url: str, content: str, message: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(content)
    code, out = invoke("run", "--redis-url", redis_url, "--scenario", str(bad))
    assert code == 2, out
    assert message in out


def test_missing_files_and_bad_flags(tmp_path: Path, redis_url: str) -> None:
    code, out = invoke("run", "--redis-url", redis_url, "--scenario", str(tmp_path / "no.toml"))
    assert code == 2 and "cannot read scenario" in out
    code, out = invoke("run", "--scenario", PLAIN, "--turns", "0")
    assert code == 2 and "--turns" in out
    code, out = invoke(
        "run", "--scenario", PLAIN, "--namespace", "bad ns!", "--redis-url", redis_url
    )
    assert code == 2 and "invalid namespace" in out
    cfg = tmp_path / "c.toml"
    cfg.write_text("[watchdog]\nsoft_idle_s = 90\nhard_idle_s = 10\n")
    code, out = invoke("run", "--scenario", PLAIN, "--config", str(cfg))
    assert code == 2 and "hard_idle_s" in out
    cfg.write_text("[redis]\nport = 1\n")
    code, out = invoke("inspect", "x", "--config", str(cfg))
    assert code == 2 and "port" in out


def test_unreachable_redis_is_a_clear_error() -> None:
    code, out = invoke("inspect", "x", "--redis-url", "redis://127.0.0.1:1/0")
    assert code == 1 and "Redis" in out


def test_run_then_inspect(redis_url: str, namespace: str, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    code, out = invoke(
        "run", "--in-process", "--redis-url", redis_url, "--namespace", namespace,
        "--config", TEST_CONFIG,
        "--scenario", PLAIN, "--turns", "3", "--run-id", "cli", "--report", str(report),
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["turns"] == 3 and data["outcomes"] == {"answered": 3}
    assert data["checkpoints"] == 3 * 11  # 10 tool batches + final, no debounce
    code, out = invoke(
        "inspect", "cli-t000001", "--redis-url", redis_url, "--namespace", namespace, "--json"
    )
    assert code == 0, out
    record = json.loads(out)
    assert record["turn_id"] == "cli-t000001" and len(record["messages"]) == 2 + 10 * 3 + 1
    assert len(record["meta"]) == len(record["messages"])
    code, out = invoke("inspect", "cli-t000001", "--redis-url", redis_url, "--namespace", namespace)
    assert code == 0 and "transcript" in out and "[ok]" in out
    assert "tokens" in out and "completion" in out
    code, out = invoke("inspect", "missing", "--redis-url", redis_url, "--namespace", namespace)
    assert code == 1 and "RecordNotFound" in out


def test_resume_with_nothing_to_do(redis_url: str, namespace: str) -> None:
    code, out = invoke("resume", "--in-process", "--redis-url", redis_url, "--namespace", namespace)
    assert code == 0 and "resumed" in out


def test_resume_quarantines_a_wrong_type_key_and_resumes_the_rest(
    redis_url: str, namespace: str
) -> None:
    """one bad key no longer stops every resume, and the exit status
    says that not every turn ended."""

    async def setup() -> None:
        client = connect(redis_url)
        keys = KeyLayout(namespace)
        engine = TurnEngine(client, keys)
        await engine.submit_many(
            *scripted_turn(load_scenario(PLAIN)), ["ok-1", "ok-2"]
        )  # in progress, not run
        await client.set(keys.turn("bad"), b"a string, not a hash")
        await client.sadd(keys.in_progress_of("bad"), "bad")
        await client.aclose()

    asyncio.run(setup())
    args = ["--redis-url", redis_url, "--namespace", namespace, "--config", TEST_CONFIG]
    code, out = invoke("resume", "--in-process", *args)
    assert code == 3, out
    assert "quarantined (1)" in out and "bad" in out
    for turn in ("ok-1", "ok-2"):
        code, shown = invoke("inspect", turn, "--json", *args)
        assert code == 0 and json.loads(shown)["counters"]["outcome"] == "answered", shown
    code, out = invoke("resume", "--in-process", *args)  # nothing left: the bad key is aside
    assert code == 0, out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[approvals]\ntimeout_s = 1e400\n", "approvals.timeout_s: Input should be a finite"),
        ("[watchdog]\ntick_s = nan\n", "watchdog.tick_s"),
        ("[redis]\nshards = true\n", "redis.shards"),
        ('[tools]\nworkers = "2"\n', "tools.workers"),
        ('[redis]\nurl = "redis://127.0.0.1:6379/abc"\n', "database 'abc' is not a number"),
        ('[redis]\nurl = "http://127.0.0.1:6379/0"\n', "scheme must be one of"),
        ('[checkpoint]\natomic = "lua"\n', "checkpoint.atomic: Input should be 'script' or"),
        ("[checkpoint]\natomic = 1\n", "checkpoint.atomic"),
        ("[checkpoint]\nactors = 0\n", "checkpoint.actors"),
        ("[checkpoint]\nbatches_in_flight = 0\n", "checkpoint.batches_in_flight"),
        ("[redis]\nshards = 4\n[checkpoint]\nactors = 8\n", "more than [redis] shards = 4"),
        ("[checkpoint]\nmin_intervl_s = 1\n", "(did you mean 'min_interval_s'?)"),
        ('[redis]\nnamspace = "x"\n', "redis.namspace: Extra inputs are not permitted (did you"),
        ("[nosuch]\nx = 1\n", "nosuch: Extra inputs are not permitted\n"),
    ],
)
def test_bad_configs_are_refused_with_exit_2(tmp_path: Path, config: str, message: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(config)
    code, out = invoke("inspect", "x", "--config", str(cfg))
    assert code == 2, out
    assert message in out


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@127.0.0.1:6379/abc", "redis://user:hunter2@[::1:6379/0", "ftp://x"]
)
def test_an_invalid_redis_url_exits_2_without_its_password(url: str) -> None:
    """exit 2, and the password never printed."""
    code, out = invoke("inspect", "x", "--redis-url", url)
    assert code == 2, out
    assert "hunter2" not in out and "invalid Redis URL" in out


def test_an_unreachable_redis_is_reported_without_its_password() -> None:
    code, out = invoke("inspect", "x", "--redis-url", "redis://admin:hunter2@127.0.0.1:1/0")
    assert code == 1 and "hunter2" not in out and "redis://admin:***@127.0.0.1:1/0" in out


def test_redact_url() -> None:
    assert redact_url("redis://u:p@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("rediss://:p@h/2") == "rediss://:***@h/2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("unix:///tmp/r.sock?db=1") == "unix:///tmp/r.sock?db=1"
    seeds = "redis://:pw@a:1,b:2/0"  # a Redis Cluster's seeds: each node is redacted
    assert redact_url(seeds) == "redis://:***@a:1,b:2/0"
    assert seed_urls(seeds) == ["redis://:pw@a:1/0", "redis://:pw@b:2/0"]
    assert seed_urls("redis://:p,w@h:1") == ["redis://:p,w@h:1"]  # a comma in the password
    with pytest.raises(ValueError, match="Port could not be cast"):
        check_redis_url("redis://a:1,b:x")


def test_run_an_agent_by_import_path(redis_url: str, namespace: str, tmp_path: Path) -> None:
    report = tmp_path / "a.json"
    code, out = invoke(
        "run", "--in-process", "--redis-url", redis_url, "--namespace", namespace,
        "--config", TEST_CONFIG, "--agent", "tests.support.agents:calculator",
        "--input", "2+3?", "--turns", "2", "--report", str(report),
    )  # fmt: skip
    assert code == 0, out
    assert json.loads(report.read_text())["outcomes"] == {"answered": 2}


def test_an_agent_that_cannot_start_here_is_refused_before_a_turn_is_written(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example agent without its API key: ``run --in-process`` used to write the turn,
    exit 3 and leave it ``running (init)`` for ever."""
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    where = ["--redis-url", redis_url, "--namespace", namespace]
    code, out = invoke("run", "--in-process", *where, "--agent",
                       "actors.examples.assistant:agent", "--input", "hi")  # fmt: skip
    assert code == 2 and "OPENAI_API_KEY" in out and "none was written" in out, out
    assert "phaseline inspect / watch" not in out  # no turn id was named
    code, out = invoke("turns", *where, "--json")
    assert code == 0 and "{" not in out, out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent", "tests.support.agents:not_an_agent", "--input", "x"], "not an Agent"),
        (["--agent", "no.such.module:agent", "--input", "x"], "cannot import"),
        (["--agent", "tests.support.agents:calculator"], "needs --input"),
        (["--scenario", PLAIN, "--agent", "tests.support.agents:calculator"], "either"),
        (["--scenario", PLAIN, "--input", "x"], "--input goes with --agent"),
        ([], "either --scenario"),
    ],
)
def test_bad_agent_flags_exit_2(redis_url: str, args: list[str], message: str) -> None:
    code, out = invoke("run", "--in-process", "--redis-url", redis_url, *args)
    assert code == 2 and message in out, out


def test_a_run_whose_turns_abort_exits_4_and_says_why(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    scenario = tmp_path / "fatal.toml"
    scenario.write_text(
        'name = "fatal"\nrounds = 2\npayload_bytes = 900\n[[faults]]\nat_call = 2\nkind = "fatal"\n'
    )
    report = tmp_path / "r.json"
    code, out = invoke(
        "run", "--in-process", "--redis-url", redis_url, "--namespace", namespace,
        "--config", TEST_CONFIG, "--scenario", str(scenario), "--turns", "2", "--run-id", "ab",
        "--report", str(report),
    )  # fmt: skip
    assert code == 4, out
    assert "turns ab-t000000 … ab-t000001" in out
    assert "2 aborted with: model fatal: scripted fatal error at call 2" in out
    data = json.loads(report.read_text())
    assert data["turn_ids"] == ["ab-t000000", "ab-t000001"]
    assert data["aborted"] == 2 and data["outcomes"] == {"aborted:fatal": 2}
    assert data["errors"] == {"model fatal: scripted fatal error at call 2": 2}
    code, out = invoke("inspect", "ab-t000000", "--redis-url", redis_url, "--namespace", namespace)
    assert code == 0, out
    assert "last error" in out and "scripted fatal error at call 2" in out
    assert "echo({" in out  # a call with its arguments, not echo()
    assert "characters; --json has all]" in out  # a 900-character reply, cut and said so


def test_turns_per_second_is_not_claimed_for_turns_that_never_finished() -> None:
    stats = RunStats(turns=3, wall_s=2.0, unfinished=["a", "b", "c"])
    assert stats.as_dict()["turns_per_s"] is None
    stats.outcomes[Outcome.ANSWERED] += 1
    assert stats.as_dict()["turns_per_s"] == 0.5


def test_sourcing_bootstrap_leaves_the_shell_options_alone() -> None:
    """``source scripts/bootstrap.sh`` (the README's way) must not leave ``set -euo pipefail``
    on in the user's shell. The extras the venv was made with are kept (nothing installs)."""
    stamp = ROOT / ".venv" / ".phaseline-installed"
    if not stamp.exists():
        pytest.skip("no .venv made by scripts/bootstrap.sh here")
    extras = stamp.read_text().split()[-1]
    for before, sign in (("set +euo pipefail", "+"), ("set -euo pipefail", "-")):
        script = f"{before}; PHASELINE_EXTRAS={extras} source scripts/bootstrap.sh; echo $-"
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        flags = done.stdout.splitlines()[-1]
        # scripts/test relies on errexit surviving the source: a failing step must stop it
        assert ("e" in flags, "u" in flags) == (sign == "-", sign == "-"), (before, flags)


def test_the_redis_url_can_come_from_a_file_not_argv(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    url_file = tmp_path / "url"
    url_file.write_text(redis_url + "\n")
    code, out = invoke("inspect", "missing", "--redis-url-file", str(url_file),
                       "--namespace", namespace)  # fmt: skip
    assert code == 1 and "RecordNotFound" in out  # it reached that Redis
    code, out = invoke("inspect", "x", "--redis-url-file", str(url_file), "--redis-url", redis_url)
    assert code == 2 and "not both" in out
    url_file.write_text("")
    code, out = invoke("inspect", "x", "--redis-url-file", str(url_file))
    assert code == 2 and "is empty" in out


def test_a_run_says_how_its_turns_were_suspended(capsys: pytest.CaptureFixture[str]) -> None:
    """A turn parked because its agent changed is not "suspended as poison": the summary names
    each suspension."""
    stats = RunStats()
    stats.add(TurnOutcome.parked("moved", Outcome.SUSPENDED_AGENT_CHANGED, 2))
    stats.add(TurnOutcome.parked("bad", Outcome.SUSPENDED_POISON, 3))
    with pytest.raises(SystemExit):
        _exit_unless_final(stats)
    said = capsys.readouterr().err
    assert "1 suspended:agent_changed, 1 suspended:poison" in said and "moved, bad" in said


def test_counts_are_said_in_the_singular_for_one() -> None:
    assert count(1, "turn") == "1 turn" and count(0, "turn") == "0 turns"
    assert count(1200, "finished turn") == "1,200 finished turns"


@pytest.mark.parametrize(
    ("faults", "said"),
    [("host", "--faults takes provider, partition"),
     ("provider", "OPENAI_BASE_URL"),  # the default demo's model is in process
     ("gremlin", "unknown chaos targets")],
)  # fmt: skip
def test_the_demos_faults_are_the_world_outsides_and_checked_before_anything_starts(
    faults: str, said: str
) -> None:
    result = CliRunner().invoke(main, ["demo", "--faults", faults, "--turns", "1"])
    assert result.exit_code == 2, result.output
    assert said in result.output
