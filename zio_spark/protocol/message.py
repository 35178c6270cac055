"""ZIO messages: the multipart codec and the czmq single-frame codec.

Theory of operation (specs/zio-wire.md, "Message = parts"):

A ZIO message is a list of parts. Part 0, the *prefix*, is ``b"ZIO"``, one ASCII level
digit ``'0'``..``'8'``, the *form* (exactly four bytes, space padded, e.g. ``b"FLOW"``)
and the *label* (UTF-8, possibly empty). Part 1, the *coord*, is exactly 24 bytes:
``origin``, ``granule`` and ``seqno`` as little-endian uint64. Any further parts are the
application's payload.

CLIENT/SERVER sockets carry one frame only, so there the parts are concatenated, each
preceded by its length: one byte when shorter than 255, else ``0xFF`` and a 4-byte
big-endian length (czmq's ``zmsg_encode``).

Messages of form ``FLOW`` carry a JSON object in the label (the *flow object*); it must
be a JSON object and must have a ``flow`` attribute. Decoding checks that, so a message
that gets past :func:`decode_frames` is safe to hand to the flow state machine.

Everything here is pure: bytes in, :class:`Message` out, and back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from enum import IntEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from zio_spark.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DAT_LABEL",
    "FLOW_FORM",
    "DatCodec",
    "Level",
    "Message",
    "decode_frames",
    "decode_single",
    "encode_flow_label",
    "encode_frames",
    "encode_single",
    "join_single",
    "parse_flow_label",
    "split_single",
]

MAGIC = b"ZIO"
FLOW_FORM = "FLOW"
COORD_SIZE = 24
_COORD = struct.Struct("<QQQ")
_U32BE = struct.Struct(">I")
_LEVEL_DIGITS = frozenset(b"012345678")


class Level(IntEnum):
    """Message levels (zio-wire.md); FLOW messages use ``UNDEFINED``."""

    UNDEFINED = 0
    TRACE = 1
    VERBOSE = 2
    DEBUG = 3
    INFO = 4
    SUMMARY = 5
    WARNING = 6
    ERROR = 7
    FATAL = 8


class Message(NamedTuple):
    """One ZIO message (immutable; a named tuple because it is made once per message
    on the hot path, where a frozen dataclass costs several times more).

    Attributes
    ----------
    form
        Four ASCII characters (``"FLOW"`` for flow messages).
    label
        The label text; for FLOW messages, the flow object as JSON.
    level
        0..8, see :class:`Level`.
    origin, granule, seqno
        The coord, each an unsigned 64-bit integer.
    payload
        Application frames.
    """

    form: str
    label: str = ""
    level: int = 0
    origin: int = 0
    granule: int = 0
    seqno: int = 0
    payload: tuple[bytes, ...] = ()

    @property
    def flow_object(self) -> Mapping[str, Any]:
        """The parsed flow object (read-only view).

        Raises
        ------
        RemoteProtocolError
            If the label is not a JSON object with a ``flow`` attribute.
        """
        return parse_flow_label(self.label)


# The hot paths build messages with tuple.__new__: the NamedTuple constructor is a Python
# function (keyword handling, defaults), several times slower for the same result.
_new_message = tuple.__new__

# Flow labels repeat endlessly (every DAT of a flow has the same one), so parsed labels
# are cached. The cache is bounded: once full, new labels are parsed but not kept.
_LABEL_CACHE: dict[str, Mapping[str, Any]] = {}
_LABEL_CACHE_MAX = 4096
# (label, view): the last label parsed once the cache was full
_last_parsed: list[tuple[str | None, Mapping[str, Any]]] = [(None, MappingProxyType({}))]


def parse_flow_label(label: str) -> Mapping[str, Any]:
    """Parse a flow object from a label; the result is a read-only mapping.

    Raises
    ------
    RemoteProtocolError
        ``field="label"`` if the label is not JSON or not a JSON object;
        ``field="flow"`` if the object has no ``flow`` attribute or it is not a string.
    """
    cached = _LABEL_CACHE.get(label)
    if cached is not None:
        return cached
    last_label, last_view = _last_parsed[0]
    if label == last_label:  # a label too many to cache, asked for twice in a row
        return last_view  # (the decoder validates it, then the flow reads it)
    try:
        obj = json.loads(label)
    except (ValueError, RecursionError) as e:
        raise RemoteProtocolError(
            f"flow label is not JSON: {label[:80]!r} ({e})", field="label", value=label
        ) from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(
            f"flow label must be a JSON object, got {type(obj).__name__}: {label[:80]!r}",
            field="label",
            value=label,
        )
    flow = obj.get("flow")
    if not isinstance(flow, str):
        raise RemoteProtocolError(
            f"flow object needs a string 'flow' attribute, got {flow!r} in {label[:80]!r}",
            field="flow",
            value=flow,
        )
    view: Mapping[str, Any] = MappingProxyType(obj)
    if len(_LABEL_CACHE) < _LABEL_CACHE_MAX:
        _LABEL_CACHE[label] = view
    else:
        _last_parsed[0] = (label, view)
    return view


def encode_flow_label(obj: Mapping[str, Any]) -> str:
    """Encode a flow object the way the Python reference does (``json.dumps`` spacing).

    Raises
    ------
    LocalProtocolError
        If the object has no string ``flow`` attribute or is not JSON-serialisable.
    """
    if not isinstance(obj.get("flow"), str):
        raise LocalProtocolError(
            f"flow object needs a string 'flow' attribute, got {obj.get('flow')!r}",
            field="flow",
            value=obj.get("flow"),
        )
    try:
        # NaN/Infinity are not JSON; a strict C++ peer would reject the label.
        return json.dumps(dict(obj), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise LocalProtocolError(f"flow object is not JSON-serialisable: {e}") from None


# Prefixes repeat too (every DAT of a flow has the same one): both directions keep a
# bounded cache, so the hot path is a dict lookup instead of validation and encoding.
_PREFIX_OUT: dict[tuple[int, str, str], bytes] = {}
_PREFIX_IN: dict[bytes, tuple[int, str, str]] = {}
_PREFIX_CACHE_MAX = 4096


def _encode_prefix(msg: Message) -> bytes:
    key = (msg.level, msg.form, msg.label)
    try:
        cached = _PREFIX_OUT.get(key)
    except TypeError:  # an unhashable field: let validation name it
        cached = None
    if cached is not None and type(msg.level) is int:
        return cached
    prefix = _build_prefix(msg)
    if len(_PREFIX_OUT) < _PREFIX_CACHE_MAX:
        _PREFIX_OUT[key] = prefix
    return prefix


def _build_prefix(msg: Message) -> bytes:
    level = msg.level
    if isinstance(level, bool) or not (isinstance(level, int) and 0 <= level <= 8):
        raise LocalProtocolError(
            f"level must be an integer 0..8, got {level!r}", field="level", value=level
        )
    form = msg.form
    try:
        form_bytes = form.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise LocalProtocolError(
            f"form must be ASCII text, got {form!r}", field="form", value=form
        ) from None
    if len(form_bytes) > 4:
        # "" is allowed: the Python reference's default form is four spaces, which
        # decodes to "" and must survive a relay.
        raise LocalProtocolError(
            f"form must be 0..4 ASCII characters, got {form!r}", field="form", value=form
        )
    try:
        label = msg.label.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        raise LocalProtocolError(
            f"label must be text encodable as UTF-8, got {msg.label!r}",
            field="label",
            value=msg.label,
        ) from None
    return b"%s%c%s%s" % (MAGIC, 48 + level, form_bytes.ljust(4), label)


def _encode_coord(msg: Message) -> bytes:
    try:
        return _COORD.pack(msg.origin, msg.granule, msg.seqno)
    except struct.error:
        raise LocalProtocolError(
            "origin, granule and seqno must be integers 0..2**64-1, got "
            f"{msg.origin!r}, {msg.granule!r}, {msg.seqno!r}",
            field="coord",
            value=(msg.origin, msg.granule, msg.seqno),
        ) from None


def encode_frames(msg: Message) -> list[bytes]:
    """Encode a message into its multipart form ``[prefix, coord, *payload]``.

    Raises
    ------
    LocalProtocolError
        If a field is out of range (level, form, coord values).
    """
    return [_encode_prefix(msg), _encode_coord(msg), *msg.payload]


def decode_frames(frames: Sequence[bytes]) -> Message:
    """Decode the multipart form ``[prefix, coord, *payload]``.

    Raises
    ------
    RemoteProtocolError
        With ``field`` set to ``frames``, ``magic``, ``level``, ``form``, ``coord``,
        ``label`` or ``flow``, naming what was wrong.
    """
    if len(frames) < 2:
        raise RemoteProtocolError(
            f"a ZIO message needs at least 2 frames (prefix, coord), got {len(frames)}",
            field="frames",
            value=len(frames),
        )
    prefix = bytes(frames[0])
    coord = frames[1]
    known = _PREFIX_IN.get(prefix)  # a prefix seen before is valid: no checks again
    level, form, label = _decode_prefix(prefix) if known is None else known
    if len(coord) != COORD_SIZE:
        raise RemoteProtocolError(
            f"coord must be exactly 24 bytes, got {len(coord)}",
            field="coord",
            value=len(coord),
        )
    origin, granule, seqno = _COORD.unpack(coord)
    if known is None:
        if form == FLOW_FORM:
            parse_flow_label(label)
        if len(_PREFIX_IN) < _PREFIX_CACHE_MAX:
            _PREFIX_IN[prefix] = (level, form, label)
    payload = tuple(map(bytes, frames[2:]))
    return _new_message(Message, (form, label, level, origin, granule, seqno, payload))


def _decode_prefix(prefix: bytes) -> tuple[int, str, str]:
    """Level, form and label of a prefix not in the cache, checked (not the flow label)."""
    if len(prefix) < 8:
        raise RemoteProtocolError(
            f"prefix must be at least 8 bytes (ZIO + level + 4-byte form), got {prefix!r}",
            field="prefix",
            value=prefix,
        )
    if prefix[:3] != MAGIC:
        raise RemoteProtocolError(
            f"bad magic: expected b'ZIO', got {prefix[:3]!r}", field="magic", value=prefix[:3]
        )
    level_byte = prefix[3]
    if level_byte not in _LEVEL_DIGITS:
        raise RemoteProtocolError(
            f"bad level: expected an ASCII digit '0'..'8', got {prefix[3:4]!r}",
            field="level",
            value=prefix[3:4],
        )
    try:
        form = prefix[4:8].decode("ascii").rstrip(" ")
    except UnicodeDecodeError:
        raise RemoteProtocolError(
            f"form must be 4 ASCII bytes, got {prefix[4:8]!r}", field="form", value=prefix[4:8]
        ) from None
    try:
        label = prefix[8:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise RemoteProtocolError(
            f"label is not valid UTF-8 ({e.reason} at byte {e.start}): {prefix[8:88]!r}",
            field="label",
            value=prefix[8:],
        ) from None
    return level_byte - 48, form, label


def _single_pieces(frames: Sequence[bytes]) -> list[bytes]:
    pieces: list[bytes] = []
    for f in frames:
        n = len(f)
        if n < 255:
            pieces.append(_SHORT_LENGTHS[n])
        elif n < 1 << 32:
            pieces.append(b"\xff" + _U32BE.pack(n))
        else:
            raise LocalProtocolError(
                f"frame of {n} bytes is too long for the single-frame form (< 2**32)",
                field="length",
                value=n,
            )
        pieces.append(f)
    return pieces


_SHORT_LENGTHS = [bytes((n,)) for n in range(255)]


def join_single(frames: Sequence[bytes]) -> bytes:
    """Concatenate frames in czmq's ``zmsg_encode`` format (pure framing, no ZIO).

    Raises
    ------
    LocalProtocolError
        If a frame is 2**32 bytes or longer.
    """
    return b"".join(_single_pieces(frames))


def split_single(data: bytes | memoryview) -> list[bytes]:
    """Split czmq's ``zmsg_encode`` format back into frames.

    Raises
    ------
    RemoteProtocolError
        ``field="length"`` if a length prefix is truncated or runs past the end.
    """
    frames: list[bytes] = []
    view = memoryview(data)
    pos = 0
    end = len(data)
    while pos < end:
        n = data[pos]
        pos += 1
        if n == 255:
            if pos + 4 > end:
                raise RemoteProtocolError(
                    f"truncated 4-byte length prefix at offset {pos - 1} of {end} bytes",
                    field="length",
                    value=pos - 1,
                )
            (n,) = _U32BE.unpack_from(data, pos)
            pos += 4
        if pos + n > end:
            raise RemoteProtocolError(
                f"frame at offset {pos} claims {n} bytes but only {end - pos} remain",
                field="length",
                value=n,
            )
        frames.append(bytes(view[pos : pos + n]))
        pos += n
    return frames


def encode_single(msg: Message) -> bytes:
    """Encode a message into czmq's single-frame form (CLIENT/SERVER sockets).

    Raises
    ------
    LocalProtocolError
        If a field is out of range.
    """
    return join_single(encode_frames(msg))


def decode_single(data: bytes | memoryview) -> Message:
    """Decode czmq's single-frame form (``data`` may be a zero-copy view of a frame).

    Raises
    ------
    RemoteProtocolError
        If the framing is broken or the parts are not a valid ZIO message.
    """
    # Fastest lane: the same head (prefix and coord length) as the last message that
    # took the fast lane below, one short payload frame: a busy flow's DATs.
    global _last_head
    head, at, same = _last_head
    if type(data) is bytes and data.startswith(head):
        rest = len(data) - at
        payload: tuple[bytes, ...] | None = None
        if rest == 0:
            payload = ()
        elif 0 < rest < 256 and data[at] == rest - 1:  # a 1-byte length (not 255: long form)
            payload = (data[at + 1 :],)
        if payload is not None:
            origin, granule, seqno = _COORD.unpack_from(data, at - COORD_SIZE)
            level, form, label = same
            return _new_message(Message, (form, label, level, origin, granule, seqno, payload))
    # Fast lane: a prefix seen before, a 24-byte coord and at most one payload frame
    # (every DAT of a flow after the first), copied once; anything else takes the full
    # path, which validates it.
    size = len(data)
    n = data[0] if size else 255
    if n < 255:
        prefix = data[1 : 1 + n]
        known = _PREFIX_IN.get(prefix if type(prefix) is bytes else bytes(prefix))
        off = n + 2
        if known is not None and size >= off + COORD_SIZE and data[off - 1] == COORD_SIZE:
            end = off + COORD_SIZE
            rest = size - end
            payload = None
            if rest == 0:
                payload = ()
            elif data[end] < 255:
                if data[end] == rest - 1:
                    payload = (bytes(data[end + 1 :]),)
            elif rest >= 5 and _U32BE.unpack_from(data, end + 1)[0] == rest - 5:
                payload = (bytes(data[end + 5 :]),)
            if payload is not None:
                # One tuple, rebound at once: threads decoding at the same time never see
                # one head with another's offsets.
                _last_head = (bytes(data[:off]), end, known)
                origin, granule, seqno = _COORD.unpack_from(data, off)
                level, form, label = known
                return _new_message(Message, (form, label, level, origin, granule, seqno, payload))
    return decode_frames(split_single(data))


# (head bytes: prefix length, prefix, coord length; offset of the payload; the prefix's
# decoded level, form and label). The initial head never matches: a first byte of 255
# (a long prefix) never takes the fast lane that sets it.
_last_head: tuple[bytes, int, tuple[int, str, str]] = (b"\xff\xff", 0, (0, "", ""))


# ----------------------------------------------------------------- the DAT fast lane
#
# Nearly every message of a busy flow is a DAT whose label is exactly {"flow": "DAT"}.
# Encoding those needs no Message: a coord pack and a join.

DAT_LABEL = '{"flow": "DAT"}'


class DatCodec:
    """Encode the plain DATs of one flow (label ``{"flow": "DAT"}``) without Messages.

    The result is byte for byte what :func:`encode_frames` / :func:`encode_single` give
    for ``Message("FLOW", DAT_LABEL, 0, origin, 0, seqno, payload)``.

    Raises
    ------
    LocalProtocolError
        If ``origin`` is not an integer 0..2**64-1.
    """

    __slots__ = ("_head", "origin", "prefix")

    def __init__(self, origin: int = 0) -> None:
        template = Message(FLOW_FORM, DAT_LABEL, 0, origin)
        _encode_coord(template)  # validates origin
        self.origin = origin
        self.prefix = _encode_prefix(template)
        self._head = bytes((len(self.prefix),)) + self.prefix + bytes((COORD_SIZE,))

    def coord(self, seqno: int) -> bytes:
        """The coord part of DAT number ``seqno``."""
        return _COORD.pack(self.origin, 0, seqno)

    def frames(self, seqno: int, payload: tuple[bytes, ...]) -> list[bytes]:
        """The multipart form ``[prefix, coord, *payload]``."""
        return [self.prefix, _COORD.pack(self.origin, 0, seqno), *payload]

    def single(self, seqno: int, payload: tuple[bytes, ...]) -> bytes:
        """The single-frame form (CLIENT/SERVER).

        Raises
        ------
        LocalProtocolError
            If a payload frame is 2**32 bytes or longer.
        """
        coord = _COORD.pack(self.origin, 0, seqno)
        if len(payload) == 1 and len(payload[0]) < 255:
            return b"".join((self._head, coord, _SHORT_LENGTHS[len(payload[0])], payload[0]))
        return b"".join((self._head, coord, *_single_pieces(payload)))
