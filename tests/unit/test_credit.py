"""The credit policies (zio_spark.protocol.credit), without sockets: examples, and
hypothesis runs of a giver and a taker that only exchange credit and DATs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import ConfigError, LocalProtocolError
from zio_spark.protocol.credit import (
    AutoPay,
    BacklogCredit,
    BacklogPay,
    QuarterWindow,
    dat_records_for,
    echoes_offer,
    pays,
)

# -- dat_records_for ---------------------------------------------------------------------


def test_dat_records_is_an_eighth_of_max_backlog_capped() -> None:
    assert dat_records_for(1_000_000, 4096) == 4096
    assert dat_records_for(2000, 4096) == 250
    assert dat_records_for(7, 4096) == 1  # never 0
    assert dat_records_for(1, 4096) == 1


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_dat_records_for_names_a_bad_max_backlog(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        dat_records_for(bad, 4096)  # type: ignore[arg-type]
    assert e.value.option == "maxBacklog" and e.value.value == bad


@given(st.integers(1, 10**9), st.integers(1, 10**5))
def test_dat_records_for_fits_eight_times_or_is_one(max_backlog: int, cap: int) -> None:
    k = dat_records_for(max_backlog, cap)
    assert 1 <= k <= cap
    assert k == 1 or 8 * k <= max_backlog


# -- BacklogCredit: examples ---------------------------------------------------------------


def test_plain_flow_is_paid_up_to_the_room_left() -> None:
    rule = BacklogCredit(100, 12)
    assert rule.pay(held=50, backlog=0, outstanding=0, arrow=False, seen=0) == BacklogPay(50, False)
    assert rule.pay(held=50, backlog=90, outstanding=3, arrow=False, seen=0) == BacklogPay(7, False)


def test_full_backlog_with_no_credit_out_is_held_back() -> None:
    rule = BacklogCredit(100, 12)
    assert rule.pay(held=10, backlog=100, outstanding=0, arrow=False, seen=0) == BacklogPay(0, True)
    # Credit still out: not held back (the giver can still send).
    assert rule.pay(held=10, backlog=100, outstanding=1, arrow=False, seen=0).held_back is False


def test_nothing_held_pays_nothing_and_holds_nothing_back() -> None:
    rule = BacklogCredit(100, 12)
    assert rule.pay(held=0, backlog=100, outstanding=0, arrow=True, seen=0) == BacklogPay(0, False)


def test_arrow_flow_is_probed_with_one_credit_until_its_dat_size_is_seen() -> None:
    rule = BacklogCredit(10_000, 100)
    assert rule.pay(held=50, backlog=0, outstanding=0, arrow=True, seen=0).amount == 1
    assert rule.pay(held=49, backlog=0, outstanding=1, arrow=True, seen=0).amount == 0
    # Another flow of the partition holds credit; this one holds none: it is probed too.
    assert (
        rule.pay(held=50, backlog=0, outstanding=5, flow_outstanding=0, arrow=True, seen=0).amount
        == 1
    )
    assert rule.pay(held=50, backlog=0, outstanding=0, arrow=True, seen=80).amount == 50


def test_a_giver_sending_bigger_dats_than_asked_is_paid_for_its_size() -> None:
    rule = BacklogCredit(10_000, 100)
    assert rule.per_dat(arrow=True, seen=1000) == 1000
    assert rule.per_dat(arrow=True, seen=10) == 100
    assert rule.per_dat(arrow=False, seen=1000) == 1
    assert rule.pay(held=50, backlog=0, outstanding=0, arrow=True, seen=1000).amount == 10


@pytest.mark.parametrize("bad", [0, -5, False])
def test_backlog_credit_names_a_bad_max_backlog(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        BacklogCredit(bad, 10)  # type: ignore[arg-type]
    assert e.value.option == "maxBacklog"


# -- BacklogCredit: a giver and a taker, simulated ------------------------------------------

_step = st.one_of(
    st.tuples(st.just("dat"), st.integers(1, 10_000)),  # one DAT of up to per_dat records
    st.tuples(st.just("commit"), st.integers(0, 10_000)),  # Spark commits that many
    st.tuples(st.just("pay"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    max_backlog=st.integers(1, 5000),
    cap=st.integers(1, 600),
    window=st.integers(1, 200),
    arrow=st.booleans(),
    steps=st.lists(_step, max_size=120),
)
def test_backlog_bound_holds_and_credit_stays_in_the_window(
    max_backlog: int, cap: int, window: int, arrow: bool, steps: list[tuple[str, int]]
) -> None:
    """Whatever order DATs, commits and payments come in: the giver never holds more
    than the window, the records stored never exceed maxBacklog, no PAY is of 0, and a
    giver with no credit is paid as soon as a DAT fits (no stall)."""
    asked = dat_records_for(max_backlog, cap)
    rule = BacklogCredit(max_backlog, asked)
    held, out, backlog, seen = window, 0, 0, 0

    def pay() -> None:
        nonlocal held, out
        p = rule.pay(held=held, backlog=backlog, outstanding=out, arrow=arrow, seen=seen)
        assert 0 <= p.amount <= held
        per_dat = rule.per_dat(arrow=arrow, seen=seen)
        fits = backlog + per_dat <= max_backlog
        if out == 0 and held > 0 and fits:
            assert p.amount >= 1, "a giver without credit must be paid when a DAT fits"
        assert p.held_back == (held > 0 and out == 0 and not fits)
        for credit, _ in pays(p.amount, None, in_ones=False):
            assert credit > 0
        held, out = held - p.amount, out + p.amount

    pay()
    for kind, n in steps:
        if kind == "dat" and out > 0:
            rows = min(n, asked) if arrow else 1  # an honest giver: at most what we asked
            out, held, backlog = out - 1, held + 1, backlog + rows
            seen = max(seen, rows) if arrow else seen
        elif kind == "commit":
            backlog -= min(n, backlog)
        elif kind == "pay":
            pay()
        assert held + out == window
        assert backlog + out * rule.per_dat(arrow=arrow, seen=seen) <= max_backlog


# -- pays ----------------------------------------------------------------------------------


def test_pays_sends_nothing_without_credit_or_ack() -> None:
    assert pays(0, None, in_ones=False) == []
    assert pays(0, None, in_ones=True) == []


def test_pays_sends_an_ack_only_pay() -> None:
    assert pays(0, {"ack": 7}, in_ones=False) == [(0, {"ack": 7})]


def test_pays_in_ones_to_an_echoing_giver() -> None:
    assert pays(3, None, in_ones=True) == [(1, None)] * 3
    assert pays(1, None, in_ones=True) == [(1, None)]
    assert pays(3, {"ack": 1}, in_ones=False) == [(3, {"ack": 1})]


def test_pays_names_a_negative_amount() -> None:
    with pytest.raises(LocalProtocolError) as e:
        pays(-1, None, in_ones=False)
    assert (e.value.field, e.value.value) == ("amount", -1)


@given(st.integers(0, 500), st.booleans(), st.booleans())
def test_pays_hands_over_exactly_the_amount_and_never_a_bare_zero(
    amount: int, ack: bool, in_ones: bool
) -> None:
    attrs = {"ack": 3} if ack else None
    out = pays(amount, attrs, in_ones=in_ones)
    assert sum(c for c, _ in out) == amount
    assert all(c > 0 or a is not None for c, a in out)
    if in_ones and amount > 1:
        assert all(c == 1 for c, _ in out)


# -- echoes_offer --------------------------------------------------------------------------

_OFFER = {"stream": "zio", "ack": True, "resume": 0, "encoding": ["arrow"], "batch": 4096}


def test_an_echo_of_our_whole_offer_reads_as_echoing() -> None:
    assert echoes_offer(_OFFER, dict(_OFFER), announced=1000, offered=1000, profile=False)
    assert echoes_offer(_OFFER, {**_OFFER, "x": 1}, announced=2000, offered=1000, profile=False)


def test_a_giver_stating_its_own_terms_does_not_echo() -> None:
    assert not echoes_offer(_OFFER, dict(_OFFER), announced=1000, offered=1000, profile=True)
    assert not echoes_offer(_OFFER, dict(_OFFER), announced=10, offered=1000, profile=False)
    assert not echoes_offer(
        _OFFER, {**_OFFER, "batch": 1}, announced=1000, offered=1000, profile=False
    )
    assert not echoes_offer(_OFFER, {}, announced=1000, offered=1000, profile=False)


# -- QuarterWindow and AutoPay ---------------------------------------------------------------


def test_quarter_window_pays_once_a_quarter_is_back() -> None:
    rule = QuarterWindow(100)
    assert [rule.to_pay(h) for h in (0, 1, 24, 25, 100)] == [0, 0, 0, 25, 100]
    assert QuarterWindow(3).to_pay(1) == 1  # a quarter of a small window is still 1


def test_quarter_window_names_a_bad_window_and_held() -> None:
    with pytest.raises(ConfigError) as e:
        QuarterWindow(0)
    assert (e.value.option, e.value.value) == ("credit", 0)
    with pytest.raises(LocalProtocolError) as e2:
        QuarterWindow(4).to_pay(-1)
    assert e2.value.field == "held"


@settings(max_examples=300)
@given(st.integers(1, 400), st.lists(st.integers(0, 50), max_size=80))
def test_quarter_window_never_exceeds_the_window_and_never_stalls(
    window: int, sends: list[int]
) -> None:
    """A giver sends bursts of DATs within its credit; the consumer pays by the rule
    after each DAT. The giver never holds more than the window, never stalls without
    credit, and once it stops everything it sent comes back but less than a quarter."""
    rule = QuarterWindow(window)
    held, out = 0, window
    for burst in sends:
        for _ in range(min(burst, out)):
            out, held = out - 1, held + 1
            n = rule.to_pay(held)
            assert n in (0, held)
            held, out = held - n, out + n
            assert 0 <= out <= window
            assert out > 0, "the giver was left without credit"
    assert held < max(1, window // 4)


@given(st.integers(0, 10**6))
def test_auto_pay_hands_back_everything(held: int) -> None:
    assert AutoPay().to_pay(held) == held


@settings(max_examples=200, deadline=None)
@given(
    max_backlog=st.integers(1, 3000),
    windows=st.lists(st.integers(1, 50), min_size=2, max_size=4),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["dat", "commit", "pay"]), st.integers(0, 3), st.integers(0, 500)
        ),
        max_size=150,
    ),
)
def test_flows_sharing_a_partition_keep_its_bound_together(
    max_backlog: int, windows: list[int], steps: list[tuple[str, int, int]]
) -> None:
    """Plain clients of a bound port that share a partition: each flow is paid by the
    rule with the partition's total outstanding credit (as the receiver's turn sums it),
    so their DATs together never take the backlog past maxBacklog."""
    rule = BacklogCredit(max_backlog, dat_records_for(max_backlog, 4096))
    held = list(windows)
    out = [0] * len(windows)
    backlog = 0

    def pay_all() -> None:
        total = sum(out)
        for i in range(len(held)):
            p = rule.pay(
                held=held[i],
                backlog=backlog,
                outstanding=total,
                flow_outstanding=out[i],
                arrow=False,
                seen=0,
            )
            held[i], out[i], total = held[i] - p.amount, out[i] + p.amount, total + p.amount

    pay_all()
    for kind, flow, n in steps:
        i = flow % len(held)
        if kind == "dat" and out[i] > 0:
            out[i], held[i], backlog = out[i] - 1, held[i] + 1, backlog + 1
        elif kind == "commit":
            backlog -= min(n, backlog)
        elif kind == "pay":
            pay_all()
        assert backlog + sum(out) <= max_backlog
        assert all(h + o == w for h, o, w in zip(held, out, windows, strict=True))
