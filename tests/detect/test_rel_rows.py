"""The batched paths against their references, one at a time: the rows
(``DecisionCore.relative_rows``, ``rel_rows`` in channels.c) against ``relative`` -- the same
alarms and the same state of every per-rank channel (gates, BOCPD bank, CUSUM and outlier
banks) after every batch, on random streams with a slow rank, spikes and invalid rows -- and
the held samples (``sample_many``, ``gate_run``) against ``sample``, on iteration times with
slowdowns, speed-ups and spikes; and rank 0's analysis thread (monitor.py ``_check``)
against the same checks on the calling thread: the same rows sent, samples seen, verdicts
and state, and an error on the thread raised by the next step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stalwart.detect import decision
from stalwart.detect.alarms import NONE, IterSample
from stalwart.detect.decision import DecisionCore

pytestmark = pytest.mark.skipif(decision._rel_rows is None, reason="channels.c not built")

GATE_FIELDS = ("seen", "pos", "quiet", "far", "slept", "model_updates", "scale_n", "pending",
               "live", "model", "scale", "centre", "x", "min_scale")


def _stream(seed: int, n: int, steps: int) -> list[tuple[int, float, list[float]]]:
    """(key, rank 0's step seconds, every rank's compute) per step: log-normal noise, one rank
    slowed by 1.3-2.5x from a random step, rare spikes, and rows with an invalid value."""
    rng = np.random.default_rng(seed)
    slow, onset, factor = int(rng.integers(n)), int(rng.integers(30, 250)), rng.uniform(1.3, 2.5)
    out = []
    for k in range(steps):
        comps = (0.05 * np.exp(rng.normal(0.0, rng.choice((0.03, 0.1, 0.2)), n))).tolist()
        if k >= onset:
            comps[slow] *= factor
        if rng.random() < 0.03:
            comps[int(rng.integers(n))] *= 6.0  # a spike
        if rng.random() < 0.02:
            comps[int(rng.integers(n))] = float(rng.choice((0.0, math.nan, math.inf, -1.0)))
        out.append((k, 0.06 + 0.9 * max(c for c in comps if 0 < c < math.inf), comps))
    return out


def _state(core: DecisionCore) -> str:
    """Everything the rows touch, as text (exact floats; nan equal to nan)."""
    s: list[object] = [core.pending, [(ch.onset, ch.decided, ch.before, ch.after, name)
                                      for ch, name in core._deferred]]
    for r, d in sorted(core.rel_detectors.items()):
        g = d._g
        s.append((r, d._row, [getattr(g, f) for f in GATE_FIELDS], len(g),
                  d._segment()[0].tolist(), d._segment()[1].tolist(),
                  [(c.onset, c.decided, c.before, c.after) for c in d.changes]))
    if core.rel_detectors:
        bank = core.rel_detectors[0].bank
        s += [a.tolist() for a in (bank.mu, bank.beta, bank.log_beta, bank.logpost, bank.n)]
    cb, ob = core.cusum, core.outliers
    if cb is not None:
        s += [cb._pos, cb.alarms] + [a.tolist() for a in (
            cb._keys, cb._xs, cb.seen, cb.start_key, cb.mu0, cb.sigma, cb.s, cb.zero_key,
            cb.backoff)]
    if ob is not None:
        s += [ob._pos, ob.seen, ob.alarms] + [a.tolist() for a in (
            ob._keys, ob._over, ob._logrel, ob._excess, ob.count, ob.filled, ob._whole,
            ob.line, ob.last_level)]
    return repr(s)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_batched_rows_equal_one_row_at_a_time(n: int, seed: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    native = decision._rel_rows

    def counted(*a: object) -> object:
        calls[0] += 1
        return native(*a)  # type: ignore[misc]

    monkeypatch.setattr(decision, "_rel_rows", counted)
    rng = np.random.default_rng(100 + seed)
    ref, bat = DecisionCore(True), DecisionCore(True)
    events = 0
    stream = _stream(seed, n, 420)
    i = 0
    while i < len(stream):
        batch = stream[i:i + int(rng.integers(1, 13))]  # a check's rows: 1 to 12
        i += len(batch)
        for core in (ref, bat):
            for k, st, comps in batch:
                core.sample(IterSample(k, st, comps[0], 0.01))
        for k, _, comps in batch:
            ref.relative(k, comps)
        bat.relative_rows([(k, comps) for k, _, comps in batch])
        assert _state(bat) == _state(ref), f"differ after step {batch[-1][0]}"
        if ref.pending.action != NONE:  # sent and forgotten: later changes raise again
            events += 1
            assert bat.take_pending(travels=False) == ref.take_pending(travels=False)
        if rng.random() < 0.05 and ref.outliers is not None:  # an alarm the tests rejected
            r = int(rng.integers(n))
            for core in (ref, bat):
                assert core.outliers is not None and core.cusum is not None
                core.outliers.unconfirmed(r)
                core.cusum.unconfirmed(r)
    assert calls[0] > 0  # the batched path ran
    changes = sum(len(d.changes) for d in ref.rel_detectors.values())
    assert events + changes + (ref.cusum.alarms if ref.cusum else 0) > 0  # it raised alarms


def test_more_ranks_than_the_batch_takes_go_one_row_at_a_time() -> None:
    """Above REF_RANKS (the pooled noise floor) ``relative_rows`` is ``relative`` per row."""
    n = 6
    ref, bat = DecisionCore(True), DecisionCore(True)
    for k, st, comps in _stream(7, n, 120):
        for core in (ref, bat):
            core.sample(IterSample(k, st, comps[0], 0.01))
        ref.relative(k, comps)
        bat.relative_rows([(k, comps)])
    assert _state(bat) == _state(ref)


def _iter_state(core: DecisionCore) -> str:
    d, g = core.detector, core.detector._g
    bank = d.bank
    return repr([core.pending, core._deferred, list(core.samples), core._seen, core._warm_s,
                 core.first_key, core.audit, d._row, [getattr(g, f) for f in GATE_FIELDS],
                 d._segment()[0].tolist(), d._segment()[1].tolist(), d.changes,
                 [a.tolist() for a in (bank.mu, bank.beta, bank.log_beta, bank.logpost,
                                       bank.n)]])


@pytest.mark.parametrize("audit", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_held_samples_equal_one_at_a_time(seed: int, audit: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the audit on, a row after each batch lets it run (it waits for the peers), and
    until it has run every sample takes ``sample``'s path."""
    calls = [0]
    native = decision._gate_run

    def counted(*a: object) -> object:
        calls[0] += 1
        return native(*a)  # type: ignore[misc]

    monkeypatch.setattr(decision, "_gate_run", counted)
    rng = np.random.default_rng(seed)
    level, samples = 0.08, []
    for k in range(800):
        if rng.random() < 0.05:  # a lasting slowdown or speed-up
            level = 0.08 * float(rng.choice((0.7, 1.0, 1.3, 1.6, 2.0)))
        st = level * float(np.exp(rng.normal(0.0, rng.choice((0.02, 0.09)))))
        if rng.random() < 0.02:
            st *= 5.0  # a spike
        samples.append(IterSample(k, st, 0.9 * st, 0.1 * st))
    ref, bat = DecisionCore(True, audit=audit), DecisionCore(True, audit=audit)
    alarms, deferred, i = 0, 0, 0
    while i < len(samples):
        batch = samples[i:i + int(rng.integers(1, 17))]
        i += len(batch)
        for s in batch:
            ref.sample(s)
        bat.sample_many(batch)
        if audit:
            comps = (0.05 * np.exp(rng.normal(0.0, 0.05, 4))).tolist()
            for core in (ref, bat):
                core.relative(batch[-1].key, comps)
        assert _iter_state(bat) == _iter_state(ref), f"differ after step {batch[-1].key}"
        if ref.pending.action != NONE and rng.random() < 0.15:  # else later changes wait
            alarms += 1
            assert bat.take_pending(travels=False) == ref.take_pending(travels=False)
        deferred += bool(ref._deferred)
    assert calls[0] > 0 and alarms > 0 and ref.detector.changes and deferred


class _Rows:
    """A stand-in row link for rank 0 (no sockets): its own row back, and three other ranks'
    rows made from it, drawn per sequence number (so two monitors read the same rows); rank 2
    1.8x slow from step 150."""

    def __init__(self) -> None:
        self.own: dict[int, list[float]] = {}

    def issue(self, seq: int, row: list[float]) -> None:
        self.own[seq] = list(row)

    def wait(self, seq: int) -> None:
        pass

    def read(self, seq: int) -> list[list[float]]:
        own = self.own.pop(seq)
        rng = np.random.default_rng(seq)
        rows, n = [own], int(own[4])
        for r in range(1, 4):
            row = [0.0, 0.0, 0.0, -1.0, float(n), 1.0] + [0.0] * (len(own) - 6)
            for j in range(n):
                key, c = own[6 + 2 * j], own[7 + 2 * j] * float(rng.lognormal(0.0, 0.08))
                row[6 + 2 * j] = key
                row[7 + 2 * j] = c * (1.8 if r == 2 and key >= 150 else 1.0)
            rows.append(row)
        return rows

    def close(self) -> None:
        pass


def test_a_monitors_held_steps_decide_as_one_step_at_a_time() -> None:
    """The live monitor's batched checks (held samples and rows, eight steps a check) leave
    the decision state exactly as a monitor whose every step goes through ``Detector.step``
    on its own (``_due`` always true: a step with no row due is analysed at once)."""
    from stalwart.detect import Monitor
    from stalwart.detect.exchange import Exchange

    mons = []
    for ref in (False, True):
        mon = Monitor(rank=0, world=1, validate_on_detect=False)
        mon.exchange = Exchange(0, _Rows(), mon.core, check_every=8, max_every=8, lag=1)
        if ref:
            mon._due = lambda c: True  # type: ignore[method-assign]
            mon._set_due = lambda: None  # type: ignore[method-assign]
            mon._due_at = 0
        mons.append(mon)
    rng = np.random.default_rng(3)
    held = 0
    for k in range(420):
        st = 0.08 * float(np.exp(rng.normal(0.0, 0.09))) * (1.5 if 300 <= k < 340 else 1.0)
        for mon in mons:
            mon.step(k, {"step_time": st, "compute_time": 0.9 * st, "comm_time": 0.1 * st})
        held = max(held, mons[0]._n_held)
    assert held == 7 and mons[1]._n_held == 0
    a, b = mons
    assert list(a.samples) == list(b.samples)  # (reading them takes the held ones in)
    assert a.report() == b.report() and a.core.hiccups == b.core.hiccups
    assert a.core.audit == b.core.audit and a.core.audit is not None
    assert a.core.outliers is not None and a.core.outliers.alarms + len(a.core.findings) > 0
    assert _state(a.core) == _state(b.core) and _iter_state(a.core) == _iter_state(b.core)
    for mon in mons:
        mon.close()


class _Sent(_Rows):
    """``_Rows`` that keeps every row rank 0 sends, in order, with the sending thread."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, list[float]]] = []
        self.threads: set[str] = set()

    def issue(self, seq: int, row: list[float]) -> None:
        import threading

        self.sent.append((seq, list(row)))
        self.threads.add(threading.current_thread().name)
        super().issue(seq, row)


def test_the_analysis_thread_decides_as_the_calling_thread() -> None:
    """Rank 0's checks analysed on the analysis thread: the same rows sent (alarms and
    periods included), the same samples shown to ``on_sample`` in the same order, the same
    verdicts and decision state as with ``analysis_thread=False`` -- with a slow rank whose
    alarms run their validation on the calling thread in between."""
    from stalwart.detect import Monitor
    from stalwart.detect.exchange import Exchange

    mons, links, seen = [], [], []
    for threaded in (False, True):
        keys: list[int] = []
        mon = Monitor(rank=0, world=1, validate_on_detect=False, analysis_thread=threaded,
                      on_sample=lambda s, keys=keys: keys.append(s.key))
        link = _Sent()
        mon.exchange = Exchange(0, link, mon.core, check_every=8, max_every=8, lag=1)
        mons.append(mon)
        links.append(link)
        seen.append(keys)
    rng = np.random.default_rng(5)
    for k in range(420):
        st = 0.08 * float(np.exp(rng.normal(0.0, 0.09))) * (1.5 if 300 <= k < 340 else 1.0)
        for mon in mons:
            mon.step(k, {"step_time": st, "compute_time": 0.9 * st, "comm_time": 0.1 * st})
    a, b = mons
    assert a.stats()["analysed_off_thread"] == 0 and b.stats()["analysed_off_thread"] > 40
    # the analysis thread's CPU, every job's (bench detect amortises it into the figure)
    assert a.analysis_cpu_us == 0.0 and b._analysis is not None
    assert b.analysis_cpu_us == pytest.approx(sum(b._analysis.cpu_us)) and b.analysis_cpu_us > 0
    assert links[0].threads == {"MainThread"}
    assert "stalwart-monitor-analysis" in links[1].threads
    assert links[0].sent == links[1].sent and len(links[0].sent) > 40
    assert any(row[0] != NONE for _, row in links[0].sent)  # (alarms travelled)
    assert list(a.samples) == list(b.samples) and seen[0] == seen[1] and len(seen[0]) == 420
    assert a.report() == b.report() and a.core.findings
    assert a.core.verdicts == b.core.verdicts and a.core.audit == b.core.audit
    assert _state(a.core) == _state(b.core) and _iter_state(a.core) == _iter_state(b.core)
    for mon in mons:
        mon.close()


def test_an_error_on_the_analysis_thread_is_raised_by_the_next_step() -> None:
    """A row send that fails on the analysis thread (a peer gone) stops the job at its next
    check (the exchange's period later) instead of its own; nothing is lost in between."""
    from stalwart.detect import Monitor
    from stalwart.detect.exchange import Exchange
    from stalwart.rowlink import RowLinkError

    class _Gone(_Rows):
        def issue(self, seq: int, row: list[float]) -> None:
            if seq == 3:
                raise RowLinkError("stalwart: rank 1 closed the monitor's row link")
            super().issue(seq, row)

    raised = []
    for threaded in (False, True):
        mon = Monitor(rank=0, world=1, validate_on_detect=False, analysis_thread=threaded)
        mon.exchange = Exchange(0, _Gone(), mon.core, check_every=8, max_every=8, lag=1)
        m = {"step_time": 0.08, "compute_time": 0.07, "comm_time": 0.01}
        with pytest.raises(RowLinkError, match="rank 1 closed"):
            for k in range(64):
                at = k
                mon.step(k, m)
        raised.append(at)
        mon.exchange._inflight.clear()  # (the failed row never left: nothing to read)
        mon.close()
    assert raised[1] == raised[0] + 8 and raised[0] > 8
