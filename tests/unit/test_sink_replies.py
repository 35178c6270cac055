"""The consumer's command replies from the sink folder's typed outcomes
(zio_spark.sink.consumer.commit_reply / abort_reply): the exact wire attributes, and
what the driver's parser makes of them. No sockets."""

from __future__ import annotations

import pytest

from zio_spark.protocol.sink import error_reply, parse_reply
from zio_spark.sink.consumer import abort_reply, commit_reply
from zio_spark.storage.sink_folder import Aborted, AlreadyCommitted, Committed


@pytest.mark.parametrize(
    ("outcome", "wire"),
    [
        (Committed("s", 3, 10, 7), {"result": "ok", "published": True, "rows": 10}),
        (Committed("s", "w-1", 0, None), {"result": "ok", "published": False, "rows": 0}),
        (
            AlreadyCommitted("s", 3),
            {"result": "ok", "published": False, "reason": "already committed"},
        ),
    ],
)
def test_commit_replies(outcome: Committed | AlreadyCommitted, wire: dict[str, object]) -> None:
    assert commit_reply(outcome) == wire
    got = parse_reply(commit_reply(outcome))
    assert got.ok and got.reason is None and dict(got.attrs) == wire


def test_abort_replies() -> None:
    assert abort_reply(Aborted("s", 1, discarded=True)) == {"result": "ok"}
    late = abort_reply(Aborted("s", 1, discarded=False))
    assert late == {"result": "ok", "reason": "already committed; nothing to discard"}
    assert parse_reply(late).ok


def test_a_refusal_is_an_error_reply_with_its_reason() -> None:
    got = parse_reply(error_reply("partition 1 attempt 0 of batch 3 is not staged"))
    assert not got.ok and got.reason == "partition 1 attempt 0 of batch 3 is not staged"
