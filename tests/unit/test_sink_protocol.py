"""The sink profile (zio_spark.protocol.sink): each rule, and the fuzz contract: any
garbage BOT, command or reply raises RemoteProtocolError and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.sink import (
    FORMATS,
    MAX_INT_ID,
    MAX_PART,
    MAX_STREAM_BYTES,
    Command,
    DataFlow,
    Staged,
    check_batch,
    check_index,
    check_stream,
    command_bot,
    data_bot,
    error_reply,
    parse_command,
    parse_data_bot,
    parse_partitions,
    parse_reply,
    parse_staged,
    pick_format,
    spark_batch_attr,
)

FUZZ = settings(max_examples=300, deadline=None)

# JSON values, as a flow label decodes them (lone surrogates included: JSON allows them).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = [
    "stream",
    "spark_batch",
    "batch",
    "partition",
    "attempt",
    "encoding",
    "format",
    "command",
    "partitions",
    "query",
    "result",
    "reason",
    "rows",
    "error",
]
# Garbage that hits the attributes the parsers read, plus near-valid values.
near_valid = st.one_of(
    json_values,
    st.sampled_from(
        ["s", "zio", "commit", "abort", "arrow", "record", "ok", "error", "a.b-c_1", "../x"]
    ),
    st.integers(-2, 3),
    st.lists(st.lists(st.integers(-1, 3), min_size=0, max_size=4), max_size=3),
    st.lists(st.sampled_from(["arrow", "record", "avro", 3]), max_size=3),
)
labels = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), near_valid, max_size=8)


@FUZZ
@given(labels)
def test_garbage_data_bot_raises_only_remote_protocol_error(attrs: dict[str, Any]) -> None:
    try:
        flow = parse_data_bot(attrs)
    except RemoteProtocolError:
        return
    assert flow.format in FORMATS
    assert (flow.batch is None) == (spark_batch_attr(attrs) is None)


@FUZZ
@given(labels)
def test_garbage_command_raises_only_remote_protocol_error(attrs: dict[str, Any]) -> None:
    try:
        cmd = parse_command(attrs)
    except RemoteProtocolError:
        return
    assert cmd.command in ("commit", "abort")
    # What parses re-encodes to a BOT that parses to the same command.
    assert (
        parse_command(command_bot(cmd.command, cmd.stream, cmd.batch, cmd.partitions, cmd.query))
        == cmd
    )


@FUZZ
@given(labels)
def test_garbage_reply_and_eot_raise_only_remote_protocol_error(attrs: dict[str, Any]) -> None:
    try:
        reply = parse_reply(attrs)
    except RemoteProtocolError:
        pass
    else:
        assert reply.ok == (attrs["result"] == "ok")
    try:
        staged = parse_staged(attrs)
    except RemoteProtocolError:
        pass
    else:
        assert staged.rows is None or staged.rows >= 0


@FUZZ
@given(near_valid)
def test_garbage_partitions_raise_only_remote_protocol_error(raw: Any) -> None:
    try:
        parts = parse_partitions(raw)
    except RemoteProtocolError:
        return
    assert len({p for p, _, _ in parts}) == len(parts)


# ----------------------------------------------------------------------------- names


def test_stream_rules() -> None:
    assert check_stream("s") == "s"
    assert check_stream("é" * (MAX_STREAM_BYTES // 2)) == "é" * (MAX_STREAM_BYTES // 2)
    for bad, what in [
        ("", "non-empty"),
        (None, "non-empty"),
        (7, "non-empty"),
        ("x" * (MAX_STREAM_BYTES + 1), "longer than"),
        ("\ud800", "not valid UTF-8"),
    ]:
        with pytest.raises(RemoteProtocolError, match=what) as info:
            check_stream(bad)
        assert info.value.field == "stream"


@pytest.mark.parametrize("good", [0, 7, MAX_INT_ID, "write-0a1b", "a", "A" * 128, "x.y_z-1"])
def test_batch_ids_accepted(good: Any) -> None:
    assert check_batch(good) == good


@pytest.mark.parametrize(
    "bad", [-1, MAX_INT_ID + 1, True, False, 1.5, None, "", "-x", "../x", "a\n", "A" * 129, [1]]
)
def test_batch_ids_refused_naming_the_attribute(bad: Any) -> None:
    with pytest.raises(RemoteProtocolError, match="spark_batch must be") as info:
        check_batch(bad)
    assert info.value.field == "spark_batch"
    with pytest.raises(RemoteProtocolError, match="batch must be") as info:
        check_batch(bad, "batch")
    assert info.value.field == "batch"


def test_index_rules() -> None:
    assert check_index("partition", 0) == 0
    assert check_index("attempt", MAX_PART - 1) == MAX_PART - 1
    for bad in (-1, MAX_PART, True, "1", None):
        with pytest.raises(RemoteProtocolError, match="attempt must be") as info:
            check_index("attempt", bad)
        assert info.value.field == "attempt"


def test_the_spark_batch_attribute_and_its_legacy_name() -> None:
    assert spark_batch_attr({"spark_batch": 1, "batch": 2}) == "spark_batch"
    assert spark_batch_attr({"batch": 2}) == "batch"
    assert spark_batch_attr({"stream": "s"}) is None


# ------------------------------------------------------------------------- data flows


def test_a_sink_bot_round_trips() -> None:
    attrs = data_bot("s", 7, 2, 1, "auto", {"x": 1})
    assert attrs == {
        "stream": "s",
        "spark_batch": 7,
        "partition": 2,
        "attempt": 1,
        "encoding": ["arrow", "record"],
        "format": "record",
        "x": 1,
    }
    flow = parse_data_bot(attrs)
    assert flow == DataFlow("s", 7, 2, 1, "arrow")
    assert flow.reply == {"encoding": "arrow"} and not flow.plain
    assert data_bot("s", 0, 0, 0, "arrow")["encoding"] == ["arrow"]
    assert data_bot("s", 0, 0, 0, "arrow")["format"] == "arrow"
    assert data_bot("s", 0, 0, 0, "record")["encoding"] == ["record"]


def test_a_plain_givers_bot() -> None:
    flow = parse_data_bot({})
    assert flow == DataFlow("zio", None, 0, 0, "record") and flow.plain and flow.reply is None


def test_a_legacy_sinks_bot_is_read() -> None:
    flow = parse_data_bot({"stream": "s", "batch": 3, "partition": 1})
    assert flow == DataFlow("s", 3, 1, 0, "arrow") and flow.reply is None
    with pytest.raises(RemoteProtocolError) as info:
        parse_data_bot({"batch": "../x", "partition": 1})
    assert info.value.field == "batch"


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"stream": 3}, "stream"),
        ({"spark_batch": -1, "partition": 0}, "spark_batch"),
        ({"spark_batch": 1}, "partition"),
        ({"spark_batch": 1, "partition": 0, "attempt": -1}, "attempt"),
        ({"encoding": ["avro"]}, "encoding"),
        ({"format": "avro"}, "format"),
    ],
)
def test_a_bad_data_bot_names_the_attribute(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_data_bot(attrs)
    assert info.value.field == field


def test_pick_format() -> None:
    assert pick_format({"encoding": ["avro", "record"]}) == ("record", {"encoding": "record"})
    assert pick_format({"encoding": "arrow"}) == ("arrow", {"encoding": "arrow"})
    assert pick_format({"format": "record", "spark_batch": 1}) == ("record", None)
    assert pick_format({"spark_batch": 1}) == ("arrow", None)
    assert pick_format({}) == ("record", None)
    with pytest.raises(RemoteProtocolError, match="offers nothing"):
        pick_format({"encoding": 5})


def test_staged_echo() -> None:
    assert parse_staged({"rows": 3}) == Staged(3, None)
    assert parse_staged({}) == Staged(None, None)
    assert parse_staged({"rows": 0, "error": "disk"}) == Staged(None, "disk")
    assert parse_staged({"error": 7}) == Staged(None, "7")
    for bad in (-1, "3", True, 1.0):
        with pytest.raises(RemoteProtocolError) as info:
            parse_staged({"rows": bad})
        assert info.value.field == "rows"


# --------------------------------------------------------------------------- commands


def test_commands_round_trip() -> None:
    bot = command_bot("commit", "s", 4, [(0, 1, 10), (2, 0, 0)], "q")
    assert bot == {
        "stream": "s",
        "spark_batch": 4,
        "command": "commit",
        "partitions": [[0, 1, 10], [2, 0, 0]],
        "query": "q",
    }
    assert parse_command(bot) == Command("commit", "s", 4, ((0, 1, 10), (2, 0, 0)), "q")
    abort = command_bot("abort", "s", "w-1")
    assert "query" not in abort
    assert parse_command(abort) == Command("abort", "s", "w-1")
    assert parse_command({"stream": "s", "batch": 2, "command": "abort"}).batch == 2
    assert parse_command({"stream": "s", "spark_batch": 2, "command": "commit"}).partitions == ()


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"spark_batch": 1, "command": "commit"}, "stream"),
        ({"stream": "s", "command": "commit"}, "spark_batch"),
        ({"stream": "s", "batch": None, "command": "commit"}, "batch"),
        ({"stream": "s", "spark_batch": 1, "command": "commit", "query": 5}, "query"),
        ({"stream": "s", "spark_batch": 1, "command": "publish"}, "command"),
        ({"stream": "s", "spark_batch": 1}, "command"),
        ({"stream": "s", "spark_batch": 1, "command": "commit", "partitions": {}}, "partitions"),
    ],
)
def test_a_bad_command_names_the_attribute(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_command(attrs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("x", "partitions"),
        ([[0, 0]], "partitions"),
        ([(0, 0, 1)], "partitions"),
        ([[-1, 0, 1]], "partition"),
        ([[0, True, 1]], "attempt"),
        ([[0, 0, -1]], "rows"),
        ([[0, 0, False]], "rows"),
        ([[0, 0, 1], [0, 1, 1]], "partitions"),
    ],
)
def test_bad_partitions_name_the_field(raw: Any, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_partitions(raw)
    assert info.value.field == field


def test_replies() -> None:
    ok = parse_reply({"result": "ok", "published": True, "rows": 3})
    assert ok.ok and ok.reason is None and ok.attrs["rows"] == 3
    err = parse_reply(error_reply("no"))
    assert not err.ok and err.reason == "no"
    for bad, field in [
        ({}, "result"),
        ({"result": "maybe"}, "result"),
        ({"result": "error"}, "reason"),
    ]:
        with pytest.raises(RemoteProtocolError) as info:
            parse_reply(bad)
        assert info.value.field == field
