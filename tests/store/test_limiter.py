"""The cluster's admission to a model endpoint (``store/domain/limiter.py``): the same assertions on
fakeredis, a real server and a real Redis Cluster (the scripts' keys share a hash tag)."""

from __future__ import annotations

import time

import pytest

from actors.engine.models.admission import schedule_of
from actors.turn.llm import MIN_PER_MINUTE, ModelLimits
from store.domain.limiter import (
    REGISTER_EVERY_S,
    STATE_KEEP_MS,
    EndpointLimiter,
    Schedule,
    endpoint_id,
)
from store.keys import KeyLayout
from store.redis.connection import StoreClient

EP = endpoint_id("http://127.0.0.1:1/v1", "m")
#: 600 requests a minute (one every 100 ms), two at once.
RATE = Schedule(request_ms=100.0, burst=2)


@pytest.fixture
def limiter(any_client: StoreClient, keys: KeyLayout) -> EndpointLimiter:
    return EndpointLimiter(any_client, keys)


async def test_a_declared_rate_admits_its_burst_then_spaces_calls(limiter: EndpointLimiter) -> None:
    assert await limiter.admit(EP, "a", RATE, 10) == 0
    assert await limiter.admit(EP, "b", RATE, 10) == 0
    wait = await limiter.admit(EP, "c", RATE, 10)
    assert 0 < wait <= 0.2  # the next place on the schedule
    assert await limiter.waiting(EP) == 1


async def test_the_line_is_served_in_the_order_calls_were_first_held_back(
    limiter: EndpointLimiter,
) -> None:
    slow = Schedule(request_ms=60_000.0, burst=1)  # one a minute
    assert await limiter.admit(EP, "first", slow, 1) == 0
    early = await limiter.admit(EP, "early", slow, 1)
    late = await limiter.admit(EP, "late", slow, 1)
    assert 0 < early < late  # the later one waits behind the earlier one
    again = await limiter.admit(EP, "early", slow, 1)  # asking again keeps its place
    assert again < await limiter.admit(EP, "late", slow, 1)
    assert await limiter.waiting(EP) == 2


async def test_a_providers_pause_holds_every_caller_back(limiter: EndpointLimiter) -> None:
    free = Schedule()
    assert await limiter.admit(EP, "x", free, 1) == 0
    await limiter.pause(EP, 5.0, 0)
    await limiter.pause(EP, 1.0, 0)  # a shorter pause never shortens a longer one
    wait = await limiter.admit(EP, "y", free, 1)
    assert 4.0 < wait <= 5.0


async def test_calls_in_flight_are_capped_and_freed_when_settled(limiter: EndpointLimiter) -> None:
    one = Schedule(max_in_flight=1)
    assert await limiter.admit(EP, "a", one, 1) == 0
    assert await limiter.admit(EP, "b", one, 1) > 0
    await limiter.settle(EP, "a", one, 0)
    assert await limiter.admit(EP, "b", one, 1) == 0


async def test_a_token_rate_counts_each_calls_tokens(limiter: EndpointLimiter) -> None:
    tokens = Schedule(token_ms=60_000 / 1_000)  # 1,000 tokens a minute, a minute's worth at once
    assert await limiter.admit(EP, "a", tokens, 900) == 0
    wait = await limiter.admit(EP, "b", tokens, 900)
    assert 40 < wait <= 48.7  # 800 tokens over: 48 s
    await limiter.settle(EP, "a", tokens, -800)  # the reply said it used 100
    assert await limiter.admit(EP, "b", tokens, 900) == 0
    assert await limiter.endpoints() == [EP]


def test_endpoint_ids_are_stable_and_keys_refuse_anything_else(keys: KeyLayout) -> None:
    assert endpoint_id("http://a/v1", "m") == endpoint_id("http://a/v1", "m") != EP
    assert keys.model_limit(EP).endswith(f"{{m:{EP}}}:limit")
    with pytest.raises(Exception, match="invalid model endpoint"):
        keys.model_limit("x}:{y")


async def test_a_snapshot_names_each_endpoint_with_its_waiters_and_pause(
    limiter: EndpointLimiter,
) -> None:
    slow = Schedule(request_ms=60_000.0, burst=1)
    assert await limiter.admit(EP, "a", slow, 1, label="m at http://127.0.0.1:1/v1") == 0
    assert await limiter.admit(EP, "b", slow, 1) > 0
    await limiter.pause(EP, 30, 0)
    (state,) = await limiter.snapshot()
    assert (state.endpoint, state.label, state.waiting) == (EP, "m at http://127.0.0.1:1/v1", 1)
    assert 25 < state.paused_s <= 30


async def test_a_waiter_that_does_not_come_back_leaves_the_line(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout
) -> None:
    """A turn that ended (or whose host died) while held back must not hold up the line."""
    slow = Schedule(request_ms=60_000.0, burst=1)
    assert await limiter.admit(EP, "first", slow, 1) == 0
    assert await limiter.admit(EP, "gone", slow, 1) > 0
    alone = await limiter.admit(EP, "next", slow, 1)
    # "gone" said it would ask again by now: make that long past, as if it never came back
    await any_client.hset(keys.model_limit(EP), "back:gone", 1)
    assert await limiter.admit(EP, "next", slow, 1) < alone
    assert await limiter.waiting(EP) == 1


async def admitted_after_the_pause(
    limiter: EndpointLimiter, ticket: str, schedule: Schedule
) -> None:
    """Ask until admitted: the pause is a millisecond, polled until it is over."""
    for _ in range(1000):
        if await limiter.admit(EP, ticket, schedule, 1) == 0:
            return
    pytest.fail("the pause did not end")


async def test_after_a_providers_pause_calls_are_spaced_without_a_burst(
    limiter: EndpointLimiter,
) -> None:
    free = Schedule()  # nothing declared: without a refusal, calls go at once
    assert await limiter.admit(EP, "a", free, 1) == 0
    assert await limiter.admit(EP, "b", free, 1) == 0
    await limiter.pause(EP, 0.001, 0)
    await admitted_after_the_pause(limiter, "c", free)
    # the next call waits for the spacing the refusal set (100 ms), instead of all at once
    assert 0.05 < await limiter.admit(EP, "d", free, 1) <= 0.1
    await limiter.pause(EP, 0.001, 0)  # a call sent under that spacing: it grows by a quarter
    wait = await limiter.admit(EP, "e", free, 1)
    assert 0.1 < wait <= 0.25


async def test_the_first_calls_to_a_new_endpoint_are_paced_until_it_refuses(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout
) -> None:
    """200 turns starting at once against a provider that takes 100 at once met 100 refusals:
    the first calls go 10 ms apart (ten at once), so its first refusal stops the rest."""
    free = Schedule()
    t0 = await server_ms(any_client)
    admitted = [await limiter.admit(EP, f"t{i}", free, 1) for i in range(12)]
    assert admitted[:10] == [0] * 10 and admitted[10] <= 0.02
    # the eleventh may go 10 ms after the first: it waits what is left of that (nothing on a
    # machine too busy to make eleven calls in 10 ms)
    assert admitted[10] > 0 or await server_ms(any_client) - t0 >= 9
    await limiter.pause(EP, 0.001, 0)  # the first refusal: the provider's own spacing, 100 ms
    assert await gap_ms(any_client, keys) == 100
    # under a declared rate, no such pacing: the schedule is the agent's word
    other = endpoint_id("http://127.0.0.1:9/v1", "m")
    assert [await limiter.admit(other, f"d{i}", RATE, 1) for i in range(2)] == [0, 0]


async def gap_ms(client: StoreClient, keys: KeyLayout) -> float:
    return float(await client.hget(keys.model_limit(EP), "gap_ms") or 0)


async def server_ms(client: StoreClient) -> int:
    sec, usec = await client.time()
    return int(sec) * 1000 + int(usec) // 1000


async def test_a_refusal_of_a_call_sent_before_the_spacing_changes_nothing_but_the_pause(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout
) -> None:
    """A slow provider's answers to calls sent before a refusal arrive after it: they say
    nothing of the spacing it set (each grew it before, up to 10 s)."""
    await limiter.pause(EP, 0.001, 0)
    assert await gap_ms(any_client, keys) == 100
    for _ in range(5):
        await limiter.pause(EP, 0.001, 5.0)  # sent 5 s ago, before the spacing was set
    assert await gap_ms(any_client, keys) == 100


@pytest.mark.parametrize(
    ("held_ms", "went", "expected"),
    [(5_000, 50, 110.0),  # 50 calls went in 5 s: 10 a second, spaced 100 ms and 10 % more
     (3_000, 6, 550.0),   # 2 a second
     (1_000, 50, 125.0),  # too brief to count: a quarter more than 100 ms
     (120_000, 50, 125.0)],  # too long: the bucket may have overflowed; a quarter more
)  # fmt: skip
async def test_the_spacing_is_the_rate_the_provider_accepted_since_the_last_refusal(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout,
    held_ms: int, went: int, expected: float,
) -> None:  # fmt: skip
    now = await server_ms(any_client)
    await any_client.hset(keys.model_limit(EP), mapping={
        "gap_ms": 100, "gap_at": now + 1_000, "regime_at": now - held_ms,
        "regime_sent": went + 1,  # the refused call was sent under it too
    })  # fmt: skip
    await limiter.pause(EP, 0.001, 0)
    assert await gap_ms(any_client, keys) == pytest.approx(expected, rel=0.01)
    # the calls admitted from now on are the next count
    assert await limiter.admit(EP, "x", Schedule(), 1) >= 0
    assert await any_client.hget(keys.model_limit(EP), "regime_sent") in (b"0", b"1")


async def test_under_a_declared_rate_a_refusal_pauses_but_does_not_slow_the_schedule(
    limiter: EndpointLimiter,
) -> None:
    await limiter.pause(EP, 0.001, 0)
    await limiter.pause(EP, 0.001, 0)  # a spacing of 125 ms for an undeclared rate
    await admitted_after_the_pause(limiter, "a", RATE)
    # Calls go on at the declared rate (100 ms), not at that spacing, and without the declared
    # burst of two: the provider's bucket was empty when it refused.
    assert 0 < await limiter.admit(EP, "b", RATE, 1) <= 0.1


async def test_endpoints_are_listed_from_the_registry_not_from_a_scan(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout
) -> None:
    """The Supervisor and the console list endpoints every few seconds: from the registry that
    callers keep, never by scanning every key of the namespace."""
    assert await limiter.admit(EP, "a", RATE, 1) == 0
    other = endpoint_id("http://127.0.0.1:2/v1", "m")
    # a state no process named (written by hand): a scan would find it, the registry does not
    await any_client.hset(keys.model_limit(other), "label", "unnamed")
    assert await limiter.endpoints() == [EP]
    # a second admit within the registration period writes nothing more
    await any_client.delete(keys.models())
    assert await limiter.admit(EP, "b", RATE, 1) == 0
    assert await limiter.endpoints() == []
    assert await EndpointLimiter(any_client, keys).admit(other, "c", RATE, 1) == 0  # a new process
    assert await limiter.endpoints() == [other]


async def test_the_registry_drops_what_outlived_its_state_and_skips_what_is_not_an_id(
    limiter: EndpointLimiter, any_client: StoreClient, keys: KeyLayout
) -> None:
    gone = endpoint_id("http://127.0.0.1:3/v1", "m")
    now_ms = int(time.time() * 1000)
    too_old = now_ms - STATE_KEEP_MS - int(REGISTER_EVERY_S * 1000) - 1
    await any_client.zadd(keys.models(), {gone: too_old, "x}:{y": now_ms, EP: now_ms})
    assert await limiter.endpoints() == [EP]  # "gone" dropped, "x}:{y" skipped with a warning
    assert await any_client.zscore(keys.models(), gone) is None
    # named but its state expired (no admit labelled it): not shown
    assert await limiter.snapshot() == []


@pytest.mark.parametrize(
    "kw",
    [{"requests_per_minute": 1e-15}, {"requests_per_minute": 1e-20},
     {"requests_per_minute": float("inf")}, {"requests_per_minute": float("nan")},
     {"tokens_per_minute": 1e-12}, {"tokens_per_minute": 1e12}, {"burst": 0},
     {"burst": 10**9}, {"max_in_flight": 0}, {"max_in_flight": 10**9}],
)  # fmt: skip
def test_a_limit_out_of_range_is_refused(kw: dict[str, float]) -> None:
    """A rate slower than one a day overflowed the limiter's arithmetic (1e-15 a minute gave a
    wait of -9.2e15 ms: every call went at once); refused when the agent is defined."""
    with pytest.raises(ValueError, match="ModelLimits"):
        ModelLimits(**kw)  # type: ignore[arg-type]


async def test_the_slowest_allowed_rate_holds_calls_back_a_day(limiter: EndpointLimiter) -> None:
    slowest = schedule_of(ModelLimits(requests_per_minute=MIN_PER_MINUTE), 60.0)
    assert await limiter.admit(EP, "first", slowest, 1) == 0
    wait = await limiter.admit(EP, "second", slowest, 1)
    assert 86_000 < wait <= 86_400  # never negative, never "go now"
