"""What the spool owns beside records: acknowledged ends (Spool.acknowledge/ack_end), the
producer ids per endpoint (peers.json) and open plain flows (plain_flows.json). No
sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import StorageInputError
from zio_spark.storage.spool import Spool
from zio_spark.storage.spool_peers import SpoolPeers

# -- ack_end -------------------------------------------------------------------------------


def test_ack_end_is_one_for_an_unknown_producer(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", sync=False) as spool:
        assert spool.ack_end("p") == 1


def test_ack_end_follows_commits_and_acknowledgements(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", sync=False) as spool:
        spool.commit({"p": 5})
        assert spool.ack_end("p") == 5
        spool.acknowledge({"p": 9})
        assert spool.ack_end("p") == 9
        assert spool.committed() == {"p": 5}  # acknowledged is not committed
        spool.acknowledge({"p": 3})  # lower: a no-op
        assert spool.ack_end("p") == 9
        spool.commit({"p": 12})
        assert spool.ack_end("p") == 12


def test_committed_ends_survive_a_restart_acknowledged_ones_do_not(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", sync=False) as spool:
        spool.commit({"p": 4})
        spool.acknowledge({"p": 10, "q": 3})
    with Spool(tmp_path / "s", sync=False) as spool:
        assert (spool.ack_end("p"), spool.ack_end("q")) == (4, 1)


@pytest.mark.parametrize("offsets", [{"p": -1}, {"p": True}, {"p": "3"}, {3: 1}])
def test_acknowledge_names_a_bad_offset(tmp_path: Path, offsets: dict) -> None:  # type: ignore[type-arg]
    with Spool(tmp_path / "s", sync=False) as spool:
        with pytest.raises(StorageInputError) as e:
            spool.acknowledge(offsets)
        assert isinstance(e.value, ValueError)
        assert spool.ack_end("p") == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=30))
def test_ack_end_is_the_highest_end_seen_and_never_falls(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[bool, int]]
) -> None:
    with Spool(tmp_path_factory.mktemp("s"), sync=False) as spool:
        highest, last = 1, 1
        for commit, end in ops:
            (spool.commit if commit else spool.acknowledge)({"p": end})
            highest = max(highest, end)
            now = spool.ack_end("p")
            assert now == highest and now >= last
            last = now


# -- peers.json ----------------------------------------------------------------------------


def test_producer_ids_are_kept_across_spools(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", sync=False) as spool:
        assert spool.peers.producer_of("tcp://a:1") is None
        spool.peers.remember("tcp://a:1", "p1")
        assert spool.peers.producer_of("tcp://a:1") == "p1"
    assert json.loads((tmp_path / "s" / "peers.json").read_text()) == {"tcp://a:1": "p1"}
    with Spool(tmp_path / "s", sync=False) as spool:
        assert spool.peers.producer_of("tcp://a:1") == "p1"


def test_an_unchanged_id_is_not_rewritten(tmp_path: Path) -> None:
    peers = SpoolPeers(tmp_path)
    peers.remember("e", "p")
    (tmp_path / "peers.json").write_text('{"e": "other"}')
    peers.remember("e", "p")  # known: no write
    assert json.loads((tmp_path / "peers.json").read_text()) == {"e": "other"}


@pytest.mark.parametrize("text", ["not json", "[1, 2]", ""])
def test_an_unreadable_file_reads_as_empty(tmp_path: Path, text: str) -> None:
    (tmp_path / "peers.json").write_text(text)
    (tmp_path / "plain_flows.json").write_text(text)
    peers = SpoolPeers(tmp_path)
    assert peers.producer_of("e") is None and peers.left_open == {}


# -- plain_flows.json ----------------------------------------------------------------------


def _flows(root: Path) -> dict[str, str]:
    return json.loads((root / "plain_flows.json").read_text())  # type: ignore[no-any-return]


def test_open_plain_flows_are_recorded_until_they_close(tmp_path: Path) -> None:
    peers = SpoolPeers(tmp_path)
    peers.mark_open("a", "pa")
    peers.mark_open("b", "pb")
    assert _flows(tmp_path) == {"a": "pa", "b": "pb"}
    peers.mark_closed("a")
    assert _flows(tmp_path) == {"b": "pb"} == peers.open_flows()
    peers.mark_closed("zzz")  # never open: nothing written
    assert _flows(tmp_path) == {"b": "pb"}


def test_flows_left_open_are_read_and_kept_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "plain_flows.json").write_text('{"a": "pa", "b": "pb"}')
    peers = SpoolPeers(tmp_path)
    assert peers.left_open == {"a": "pa", "b": "pb"}
    assert _flows(tmp_path) == {"a": "pa", "b": "pb"}  # reading changes nothing
    peers.keep_open("a")
    peers.keep_open("nope")
    assert _flows(tmp_path) == {"a": "pa", "b": "pb"}  # kept with the next write
    peers.mark_open("c", "pc")
    assert _flows(tmp_path) == {"a": "pa", "c": "pc"}
