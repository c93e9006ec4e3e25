"""WarmupPolicy.decide: every gate, in order, with its exact reason and fallbacks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv.warmup import JobState, TargetState, TokenBucket, WarmupDecision, WarmupPolicy

JOB = JobState("coder", probability=0.8, observed=True, predictability=0.6)
COLD = TargetState(anchor_blocks=4, resident=False, waiting=0, running=1, free_blocks=100)
POLICY = WarmupPolicy(r_min=0.3, min_probability=0.5, max_waiting=0, max_load=3, min_free_blocks=2)


def decide(job: JobState = JOB, target: TargetState = COLD, take: bool = True) -> WarmupDecision:
    return POLICY.decide(job, target, lambda: take)


def test_a_cold_anchor_with_room_is_warmed() -> None:
    decision = decide()
    assert decision == WarmupDecision("warm") and decision.warm


@pytest.mark.parametrize(("job", "reason"), [
    (replace(JOB, session_ended=True, late=True), "session_ended"),
    (replace(JOB, late=True), "late"),
    (replace(JOB, predicted=None), "no_prediction"),
    (replace(JOB, observed=False), "no_prediction"),
    (replace(JOB, probability=0.49, predictability=0.0), "unlikely"),
    (replace(JOB, predictability=0.29), "predictability"),
])
def test_job_gates(job: JobState, reason: str) -> None:
    assert decide(job) == WarmupDecision(reason)


@pytest.mark.parametrize(("target", "reason"), [
    (replace(COLD, resident=True, anchor_blocks=0, waiting=9), "resident"),
    (replace(COLD, anchor_blocks=0, waiting=9), "no_anchor"),
    (replace(COLD, waiting=1), "busy"),
    (replace(COLD, waiting=0, running=4), "busy"),
    (replace(COLD, free_blocks=5), "no_room"),  # 4 for the anchor + a reserve of 2
])
def test_target_gates(target: TargetState, reason: str) -> None:
    assert decide(target=target) == WarmupDecision(reason)


def test_enough_room_is_the_anchor_plus_the_reserve() -> None:
    assert decide(target=replace(COLD, free_blocks=6)).warm


def test_rate_limit_is_asked_last_and_only_when_everything_else_passed() -> None:
    asked: list[bool] = []

    def take() -> bool:
        asked.append(True)
        return False

    assert POLICY.decide(replace(JOB, late=True), COLD, take) == WarmupDecision("late")
    assert POLICY.decide(JOB, replace(COLD, resident=True), take) == WarmupDecision("resident")
    assert asked == []
    assert POLICY.decide(JOB, COLD, take) == WarmupDecision("rate_limit")
    assert asked == [True]


def test_the_target_is_only_looked_up_when_the_job_gates_pass() -> None:
    looked: list[bool] = []

    def target() -> TargetState:
        looked.append(True)
        return COLD

    assert POLICY.decide(replace(JOB, predictability=0.1), target) == WarmupDecision("predictability")
    assert looked == []
    assert POLICY.decide(JOB, target).warm and looked == [True]


def test_unknown_inputs_do_not_block_and_are_reported() -> None:
    unknown = TargetState(anchor_blocks=4)
    assert decide(target=unknown) == WarmupDecision("warm", ("residency_unknown", "load_unknown", "room_unknown"))
    assert decide(target=replace(unknown, anchor_blocks=0)) == WarmupDecision("no_anchor", ("residency_unknown",))
    assert decide(target=replace(unknown, waiting=2)) == WarmupDecision("busy", ("residency_unknown",))


def test_a_manual_warmup_skips_the_prediction_gates_but_not_the_session_ones() -> None:
    manual = JobState("coder", probability=0.0, observed=False, predictability=0.0, manual=True)
    assert decide(manual).warm
    assert decide(replace(manual, late=True)) == WarmupDecision("late")


def test_load_checks_can_be_turned_off() -> None:
    policy = WarmupPolicy(max_waiting=None, max_load=None, weigh_load=False)
    assert policy.decide(JOB, replace(COLD, waiting=50, running=50)).warm


@pytest.mark.parametrize(("probability", "running", "warm"), [
    (0.01, 0, True),  # an idle engine: nothing to delay
    (0.5, 1, True),  # 0.5 * 2 >= 1: the saving pays for the delay
    (0.49, 1, False),
    (0.75, 3, True),
    (0.74, 3, False),
    (1.0, 50, True),  # a certain call: the prefill only moves earlier
])
def test_the_price_weighs_the_prediction_against_the_running_requests(
    probability: float, running: int, warm: bool
) -> None:
    policy = WarmupPolicy(max_waiting=0, max_load=None)
    decision = policy.decide(replace(JOB, probability=probability), replace(COLD, running=running))
    assert decision == WarmupDecision("warm" if warm else "costly")
    assert WarmupPolicy(max_load=None, weigh_load=False).decide(
        replace(JOB, probability=probability), replace(COLD, running=running)).warm


def test_the_price_weighs_the_prediction_by_the_warmups_that_survived() -> None:
    policy = WarmupPolicy(max_load=None)
    job = replace(JOB, probability=1.0)
    assert policy.decide(job, replace(COLD, running=2, survival=0.67)).warm  # 0.67 * 3 >= 2
    assert policy.decide(job, replace(COLD, running=2, survival=0.66)) == WarmupDecision("costly")
    assert policy.decide(job, replace(COLD, running=0, survival=0.01)).warm  # an idle engine


def test_requests_waiting_are_delayed_too_when_the_busy_gate_lets_them() -> None:
    policy = WarmupPolicy(max_waiting=None, max_load=None)
    job = replace(JOB, probability=0.7)
    assert policy.decide(job, replace(COLD, running=2, waiting=0)).warm  # 0.7 * 3 >= 2
    assert policy.decide(job, replace(COLD, running=2, waiting=1)) == WarmupDecision("costly")  # 0.7 * 4 < 3


def test_a_manual_warmup_pays_any_price() -> None:
    manual = JobState("coder", probability=0.0, manual=True)
    assert WarmupPolicy(max_load=None).decide(manual, replace(COLD, running=20, survival=0.1)).warm


def test_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, capacity=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] += 0.5
    assert bucket.take() and not bucket.take()
    now[0] += 100
    assert sum(bucket.take() for _ in range(10)) == 3
