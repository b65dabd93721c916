"""The elastic protocol's decisions (pure, no torch): who trains in the next generation, from
which step, who receives the state, how a step's global batch is split."""

from __future__ import annotations

import pytest

from stalwart.elastic import protocol as P
from stalwart.elastic.protocol import Ack, Generation


def gen(g: int, *members: int, weights: tuple[float, ...] = ()) -> Generation:
    return Generation(g, tuple(members), weights)


def test_the_first_generation_waits_for_min_world_joiners() -> None:
    assert P.next_generation(None, [1, 2, 3], [1, 2, 3], min_world=4) is None
    g0 = P.next_generation(None, [1, 2, 3, 4], [4, 2, 3, 1], min_world=4)
    assert g0 == Generation(0, (1, 2, 3, 4), (), "initial")


def test_a_death_and_a_join_make_the_next_generation() -> None:
    g = gen(3, 1, 2, 3, 4)
    lost = P.next_generation(g, alive=[1, 2], joiners=[], min_world=4)
    assert lost is not None and lost.gen == 4 and lost.members == (1, 2)
    assert "lost 3,4" in lost.why
    back = P.next_generation(lost, alive=[1, 2, 7, 8], joiners=[7, 8], min_world=4)
    assert back is not None and back.members == (1, 2, 7, 8) and "joined 7,8" in back.why
    assert P.next_generation(g, alive=[1, 2, 3, 4], joiners=[], min_world=4) is None


def test_no_generation_without_members() -> None:
    assert P.next_generation(gen(1, 1, 2), alive=[], joiners=[], min_world=1) is None


def test_parked_members_leave_and_are_not_admitted() -> None:
    g = gen(0, 1, 2, 3, 4)
    out = P.next_generation(g, alive=[1, 2, 3, 4], joiners=[], min_world=1, parked=[3, 4])
    assert out is not None and out.members == (1, 2)
    assert P.next_generation(out, alive=[1, 2, 9], joiners=[9], min_world=1, parked=[9]) is None


def test_reweighting_makes_a_generation_with_the_same_members() -> None:
    g = gen(0, 1, 2)
    out = P.next_generation(g, alive=[1, 2], joiners=[], min_world=1, weights={1: 1.0, 2: 0.5})
    assert out is not None and out.members == (1, 2) and out.weights == (1.0, 0.5)
    assert out.why == "reweighted"
    assert P.next_generation(out, alive=[1, 2], joiners=[], min_world=1,
                             weights={1: 1.0, 2: 0.5}) is None
    # equal weights again: back to "no weights"
    back = P.next_generation(out, alive=[1, 2], joiners=[], min_world=1, weights={})
    assert back is not None and back.weights == ()


def test_settle_starts_after_the_most_advanced_member_and_moves_state_to_the_others() -> None:
    g = gen(2, 1, 2, 5)
    st = P.settle(g, {1: Ack(41, False), 2: Ack(42, False), 5: Ack(-1, True)})
    assert st.start_step == 43 and st.source == 2 and st.receivers == (1, 5)


def test_settle_moves_nothing_when_all_members_are_at_the_same_step() -> None:
    st = P.settle(gen(1, 1, 2), {1: Ack(9, False), 2: Ack(9, False)})
    assert st == P.Settlement(10, 1, ())


def test_settle_of_a_fresh_job_broadcasts_the_lowest_members_weights() -> None:
    st = P.settle(gen(0, 3, 4, 7), {3: Ack(-1, True), 4: Ack(-1, True), 7: Ack(-1, True)})
    assert st == P.Settlement(0, 3, (4, 7))


def test_settle_needs_every_ack() -> None:
    with pytest.raises(ValueError, match=r"no ack from members \[2\]"):
        P.settle(gen(1, 1, 2), {1: Ack(3, False)})


def test_a_collective_is_given_up_only_when_it_cannot_finish() -> None:
    cur = gen(1, 1, 2, 3)
    # a member lost: give up
    assert P.must_abandon(cur, gen(2, 1, 2), step=10, acks={})
    # only a joiner added, everyone still in step 10: keep waiting
    assert not P.must_abandon(cur, gen(2, 1, 2, 3, 9), 10, {9: Ack(-1, True)})
    # a member acked the new generation before starting step 10: it will not contribute
    assert P.must_abandon(cur, gen(2, 1, 2, 3, 9), 10, {3: Ack(9, False)})
    assert not P.must_abandon(cur, gen(2, 1, 2, 3, 9), 10, {3: Ack(10, False)})
    # a parked member is alive: the step in flight finishes with it...
    assert not P.must_abandon(cur, gen(2, 1, 2), 10, {}, parked=[3])
    # ...unless it stopped before the step (it acks the generation that leaves it out)
    assert P.must_abandon(cur, gen(2, 1, 2), 10, {3: Ack(9, False)}, parked=[3])


@pytest.mark.parametrize("batch,world", [(64, 4), (64, 3), (7, 3), (5, 8), (1, 1)])
def test_shares_cover_the_global_batch_exactly_once(batch: int, world: int) -> None:
    g = gen(0, *range(10, 10 + world))
    s = P.shares(batch, g)
    got = [p for m in g.members for p in s[m]]
    assert got == list(range(batch))
    sizes = [len(s[m]) for m in g.members]
    assert max(sizes) - min(sizes) <= 1


def test_shares_follow_the_weights() -> None:
    g = gen(0, 1, 2, weights=(3.0, 1.0))
    s = P.shares(64, g)
    assert s[1] == range(0, 48) and s[2] == range(48, 64)
    with pytest.raises(ValueError):
        P.shares(64, gen(0, 1, weights=(0.0,)))


def test_micro_batches_are_global_sample_indices_of_the_step() -> None:
    assert P.micro_batches(range(4, 10), step=2, global_batch=16, micro_batch=4) == [
        [36, 37, 38, 39], [40, 41]]
    assert P.micro_batches(range(0, 3), 0, 3, None) == [[0, 1, 2]]
    assert P.micro_batches(range(0, 0), 0, 3, None) == []


def test_a_member_is_dead_after_its_counter_stops_moving_for_the_bound() -> None:
    live = P.Liveness(dead_after=3.0)
    live.beat(1, 5, now=0.0)
    live.beat(2, 9, now=0.0)
    live.beat(1, 6, now=2.0)
    live.beat(2, 9, now=2.0)  # no progress
    assert live.silent(2.9) == set()
    assert live.silent(3.1) == {2}
    live.beat(1, 6, now=5.5)
    assert live.silent(5.5) == {1, 2}
    live.forget(2)
    assert live.silent(5.5) == {1}


def test_a_mismatch_names_what_differs() -> None:
    job = {"code version": "aaa", "global batch": "64"}
    assert P.mismatch(dict(job), job) is None
    why = P.mismatch({"code version": "bbb", "global batch": "64"}, job)
    assert why == "this process's code version (bbb) differs from the job's (aaa)"


def test_records_round_trip() -> None:
    m = P.Member(3, "node-a", 1, "10.0.0.1:5555")
    assert P.Member.from_json(m.to_json()) == m
    g = Generation(4, (1, 3), (1.0, 2.0), "joined 3")
    assert Generation.from_json(g.to_json()) == g and g.rank_of(3) == 1 and g.weight_of(3) == 2
    assert Ack.from_text(Ack(12, True).to_text()) == Ack(12, True)


@pytest.mark.parametrize("call,phase,expect", [
    ("commit", P.IDLE, "job.commit() called outside a step"),
    ("my_batch", P.COMMITTED, "job.my_batch() called after job.commit()"),
    ("weight", P.FINISHED, "job.weight() called after job.steps() finished"),
    ("commit", P.REDO, "job.commit() called after job.commit() returned False"),
])
def test_calls_out_of_order_name_the_call(call: str, phase: str, expect: str) -> None:
    why = P.order_error(call, phase)
    assert why is not None and why.startswith(expect) and "\n" not in why


def test_my_batch_must_name_the_step_in_flight() -> None:
    assert P.order_error("my_batch", P.COMPUTE, step=5, asked=5) is None
    assert P.order_error("my_batch", P.COMPUTE, step=5, asked=4) == (
        "job.my_batch(4) called in step 5 (pass the step job.steps() gave)")
