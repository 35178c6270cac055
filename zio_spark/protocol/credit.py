"""Credit policies: when a taker hands credit back to its giver, and how much.

The flow machine (:mod:`.flow`) counts credit: what the taker holds to give
(``Flow.credit``) and what the giver holds (``Flow.outstanding``). What it does not
decide is *when* held credit goes back; that decides throughput and memory, so each rule
is here, pure and tested on its own (as h2 keeps its window policy in one class):

- :class:`BacklogCredit` -- the source receiver's ``maxBacklog`` rule: credit only while
  the records stored above the committed offset plus every DAT the giver may still send
  fit in ``maxBacklog``. The option works through a second mechanism too: the records
  per DAT the receiver asks for, :func:`dat_records_for`, so that a credit's worth of
  records is small beside the bound.
- :func:`pays` -- how a payment goes on the wire: one PAY, an ack-only PAY of 0 (only
  with an ack), or PAYs of 1 to a giver that may be echoing our offer
  (:func:`echoes_offer`).
- :class:`QuarterWindow` -- the sink consumer's rule: pay back once a quarter of the
  window is back (one PAY per quarter, not per DAT).
- :class:`AutoPay` -- a taker endpoint's default: everything held, before each read.

Each rule's ``to_pay``/``pay`` returns an amount ``0 <= n <= held``: a rule never
creates credit, so the giver never holds more than the window it was offered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zio_spark.errors import LocalProtocolError, check_count

__all__ = [
    "AutoPay",
    "BacklogCredit",
    "BacklogPay",
    "QuarterWindow",
    "dat_records_for",
    "echoes_offer",
    "pays",
]


def dat_records_for(max_backlog: int, cap: int) -> int:
    """Records per DAT a receiver bounded by ``max_backlog`` asks its givers for.

    At most ``cap`` (large DATs cost far less per record), at most an eighth of
    ``max_backlog`` (so a partly full backlog still has room for whole DATs), at least 1.

    Raises
    ------
    ConfigError
        If ``max_backlog`` is not an int >= 1 or ``cap`` not an int >= 1.
    """
    check_count("maxBacklog", max_backlog, 1)
    check_count("cap", cap, 1)
    return max(1, min(cap, max_backlog // 8))


@dataclass(frozen=True)
class BacklogPay:
    """What :meth:`BacklogCredit.pay` decided: credits to pay now, and whether the
    partition is held back (``maxBacklog`` reached while its givers hold no credit)."""

    amount: int
    held_back: bool


class BacklogCredit:
    """The ``maxBacklog`` rule of one receiver (the same for all its partitions).

    A giver holding ``outstanding`` credits may send that many DATs of up to
    :meth:`per_dat` records each. Credit goes back only while
    ``backlog + (outstanding + n) * per_dat <= max_backlog``: that bound then holds at
    every moment, whatever the giver does with its credit, as long as its DATs carry
    at most ``per_dat`` records.

    Parameters
    ----------
    max_backlog
        Most records stored above the committed offset, per partition.
    dat_records
        Records per DAT asked of Arrow givers (see :func:`dat_records_for`).
    """

    def __init__(self, max_backlog: int, dat_records: int) -> None:
        self.max_backlog = check_count("maxBacklog", max_backlog, 1)
        self.dat_records = check_count("dat_records", dat_records, 1)

    def per_dat(self, *, arrow: bool, seen: int) -> int:
        """Records one DAT may carry: one in a plain DAT; in an Arrow DAT what we asked
        for, or more if the giver was ``seen`` sending more (it ignores our ``batch``)."""
        return max(self.dat_records, seen) if arrow else 1

    def pay(
        self,
        *,
        held: int,
        backlog: int,
        outstanding: int,
        flow_outstanding: int | None = None,
        arrow: bool,
        seen: int,
    ) -> BacklogPay:
        """Credits to pay one flow now.

        ``held``: credit this flow's taker holds to give; ``backlog``: records stored
        above the committed offset for the partition; ``outstanding``: credit the
        partition's givers hold (all its flows, payments made this turn included);
        ``flow_outstanding``: what this flow's giver holds (default ``outstanding``);
        ``arrow``/``seen``: the flow's encoding and the most records seen in one of its
        DATs (0: none yet). An Arrow giver whose DAT size is not known yet gets one
        credit at a time: its first DAT shows the size.
        """
        if held <= 0:
            return BacklogPay(0, False)
        if flow_outstanding is None:
            flow_outstanding = outstanding
        per_dat = self.per_dat(arrow=arrow, seen=seen)
        room = (self.max_backlog - backlog) // per_dat - outstanding
        held_back = room <= 0 and outstanding == 0
        if arrow and seen == 0:
            room = min(room, 1 - flow_outstanding)  # probe: how big are its DATs?
        return BacklogPay(max(0, min(held, room)), held_back)


def pays(
    amount: int, ack: Mapping[str, Any] | None, *, in_ones: bool
) -> list[tuple[int, Mapping[str, Any] | None]]:
    """The PAYs that hand over ``amount`` credits with the ``ack`` attributes (None: no
    ack), as ``(credit, attrs)`` pairs, in order.

    No PAY when there is nothing to say; a PAY of 0 only to carry an ack (a C++ reference
    giver blocked in ``put()`` throws on a bare PAY of 0). ``in_ones``: a giver that may
    be echoing our offer (:func:`echoes_offer`) gets PAYs of 1, which a reference giver
    (one message taken per DAT it sends) always accepts whatever its real window.

    Raises
    ------
    LocalProtocolError
        If ``amount`` is negative.
    """
    if amount < 0:
        raise LocalProtocolError(
            f"a payment of {amount} credits; expected >= 0", field="amount", value=amount
        )
    if amount == 0 and ack is None:
        return []
    if in_ones and amount > 1:
        return [(1, None)] * amount
    return [(amount, ack)]


def echoes_offer(
    sent: Mapping[str, Any],
    reply: Mapping[str, Any],
    *,
    announced: int,
    offered: int,
    profile: bool,
) -> bool:
    """True if a giver's BOT reply may be an echo of our offer ``sent``: a plain giver
    (no zio-spark ``profile``) that sent back every attribute of ours and ``announced``
    at least the credit we ``offered``. A C++ reference server does that whatever its
    own window, so its real window is unknown: pay it in ones (:func:`pays`)."""
    if profile:
        return False
    return announced >= offered and all(reply.get(k) == v for k, v in sent.items())


class QuarterWindow:
    """The sink consumer's rule: hand back what is held once it is at least a quarter
    of the ``window`` offered (and at least 1), so a busy flow costs one PAY per
    quarter window; a giver that has used all its credit always gets it back.

    Raises
    ------
    ConfigError
        If ``window`` is not an int >= 1.
    """

    def __init__(self, window: int) -> None:
        self.window = check_count("credit", window, 1)
        self.threshold = max(1, window // 4)

    def to_pay(self, held: int) -> int:
        """Credits to pay now, holding ``held`` (0 or all of it)."""
        _check_held(held)
        return held if held >= self.threshold else 0


class AutoPay:
    """A taker endpoint's default (the reference's behaviour): everything held goes
    back before each read."""

    def to_pay(self, held: int) -> int:
        """Credits to pay now, holding ``held`` (all of it)."""
        _check_held(held)
        return held


def _check_held(held: int) -> None:
    if held < 0:
        raise LocalProtocolError(
            f"a taker holding {held} credits; expected >= 0", field="held", value=held
        )
