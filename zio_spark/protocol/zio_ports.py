"""ZIO on ZRE: the ``zio.port.*`` HELLO headers that advertise a node's ZIO flow ports.

A peer advertises each flow port in its HELLO headers as ``zio.port.<name>.address`` and
``zio.port.<name>.socket``: :func:`zio_port_headers` writes them, :func:`advertised_ports`
reads them back from one peer's headers, and :func:`group_zio_endpoints` lists them for
every entered peer of a group in a :class:`~zio_spark.protocol.zre_peers.PeerTable`. Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from uuid import UUID

from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol.zre import _UINT8_MAX, _text_bytes

if TYPE_CHECKING:
    from zio_spark.protocol.zre_peers import PeerTable

__all__ = [
    "ZIO_PORT_PREFIX",
    "ZioEndpoint",
    "ZioPort",
    "advertised_ports",
    "group_zio_endpoints",
    "zio_port_headers",
]

ZIO_PORT_PREFIX = "zio.port."
_PORT_FIELDS = ("address", "socket")


class ZioPort(NamedTuple):
    """One advertised ZIO flow port: where to connect and the socket type found there."""

    address: str
    socket: str


@dataclass(frozen=True, slots=True)
class ZioEndpoint:
    """A ZIO flow port advertised by a peer in a group."""

    peer: UUID
    peer_name: str
    port: str
    address: str
    socket: str


def _check_port_name(name: object) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise LocalProtocolError(
            f"ZIO port name: got {name!r}, expected a non-empty name without '.'",
            field="name",
            value=name,
        )
    return name


def zio_port_headers(name: str, address: str, socket: str) -> dict[str, str]:
    """Return the HELLO headers that advertise one ZIO flow port.

    Parameters
    ----------
    name
        The port's name (non-empty, no ``.``), e.g. ``"out"``.
    address
        The endpoint peers connect to, e.g. ``"tcp://10.0.0.5:41000"``.
    socket
        The socket type bound there, e.g. ``"SERVER"`` or ``"ROUTER"``.

    Returns
    -------
    dict
        ``{"zio.port.<name>.address": address, "zio.port.<name>.socket": socket}``.

    Raises
    ------
    LocalProtocolError
        If ``name`` is empty, contains ``.``, or makes a header name longer than 255
        UTF-8 bytes, or ``address`` or ``socket`` is empty.
    """
    _check_port_name(name)
    for label, value in (("address", address), ("socket", socket)):
        if not isinstance(value, str) or not value:
            raise LocalProtocolError(
                f"ZIO port {name!r} {label}: got {value!r}, expected a non-empty string",
                field=label,
                value=value,
            )
    headers = {
        f"{ZIO_PORT_PREFIX}{name}.address": address,
        f"{ZIO_PORT_PREFIX}{name}.socket": socket,
    }
    for key in headers:
        _text_bytes(key, _UINT8_MAX, "headers")
    return headers


def advertised_ports(headers: Mapping[str, str]) -> dict[str, ZioPort]:
    """Return the ZIO flow ports a peer advertises in its HELLO headers.

    Keys under ``zio.port.`` that are not ``zio.port.<name>.address`` or
    ``zio.port.<name>.socket`` (with a non-empty name without ``.``) are ignored, so
    later attributes can be added without breaking older readers.

    Parameters
    ----------
    headers
        A peer's headers (e.g. :attr:`~zio_spark.protocol.zre_peers.Peer.headers`).

    Returns
    -------
    dict
        Port name -> :class:`ZioPort` ``(address, socket)``, sorted by name.

    Raises
    ------
    RemoteProtocolError
        If a port has an address but no socket or the reverse, or an empty value;
        ``field`` is the offending header name.
    """
    found: dict[str, dict[str, str]] = {}
    for key, value in headers.items():
        if not key.startswith(ZIO_PORT_PREFIX):
            continue
        name, _, attribute = key[len(ZIO_PORT_PREFIX) :].rpartition(".")
        if not name or "." in name or attribute not in _PORT_FIELDS:
            continue
        if not value:
            raise RemoteProtocolError(
                f"ZIO port header {key}: got '', expected a non-empty {attribute}",
                field=key,
                value=value,
            )
        found.setdefault(name, {})[attribute] = value
    ports: dict[str, ZioPort] = {}
    for name in sorted(found):
        attributes = found[name]
        for attribute in _PORT_FIELDS:
            if attribute not in attributes:
                key = f"{ZIO_PORT_PREFIX}{name}.{attribute}"
                raise RemoteProtocolError(
                    f"ZIO port header {key}: missing, expected it alongside "
                    f"{ZIO_PORT_PREFIX}{name}.{next(iter(attributes))}",
                    field=key,
                    value=None,
                )
        ports[name] = ZioPort(attributes["address"], attributes["socket"])
    return ports


def group_zio_endpoints(
    table: PeerTable, group: str, *, port: str | None = None
) -> list[ZioEndpoint]:
    """List the ZIO flow ports advertised by the entered peers in ``group``.

    A peer whose advertisement is malformed (see :func:`advertised_ports`) is left out
    rather than failing the whole listing; call :func:`advertised_ports` on its headers
    to see why.

    Parameters
    ----------
    table
        The node's peer table.
    group
        The ZRE group.
    port
        Only this port name, if given.

    Returns
    -------
    list of ZioEndpoint
        Sorted by peer UUID, then port name.
    """
    endpoints: list[ZioEndpoint] = []
    for peer in table.peers_in_group(group):
        try:
            ports = advertised_ports(peer.headers)
        except RemoteProtocolError:
            continue
        for name, (address, socket) in ports.items():
            if port is None or name == port:
                endpoints.append(ZioEndpoint(peer.uuid, peer.name, name, address, socket))
    return endpoints
