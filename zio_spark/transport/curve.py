"""CURVE security in one place: key parsing and checks, socket setup, the ZAP handler.

Every CURVE key the project accepts goes through :func:`curve_key` (Z85 text, Z85 bytes
or 32 raw bytes, errors naming the option; secret keys are never echoed back), and
every key pair through :func:`key_pair`. :func:`apply_server` / :func:`apply_client` set
the socket options. A port takes its keys as one :class:`~zio_spark.options.Curve`:
:func:`server_curve` / :func:`client_curve` build one from keys in any accepted form
(:func:`optional_server_curve` / :func:`optional_client_curve` from the optional key
keywords of a user-facing constructor such as ``Producer``'s), and :func:`server_keys` /
:func:`client_keys` check one for a port. :class:`CurveAuthenticator`
(see :func:`start_authenticator`) is the ZAP handler that admits clients from an
allow-list of public keys. Without an authenticator any client that knows the server's
public key is accepted.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Hashable, Iterable
from types import TracebackType

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import Curve

__all__ = [
    "CurveAuthenticator",
    "apply_client",
    "apply_server",
    "client_curve",
    "client_keys",
    "curve_key",
    "key_pair",
    "optional_client_curve",
    "optional_server_curve",
    "server_curve",
    "server_keys",
    "start_authenticator",
]

log = logging.getLogger("zio_spark.transport")

_EXPECTED = "a Z85 CURVE key (40 characters) or 32 raw bytes"


def curve_key(key: str | bytes, option: str) -> bytes:
    """A CURVE key as Z85 bytes (40 characters), from Z85 text or bytes, or 32 raw bytes.

    Raises
    ------
    ConfigError
        Naming ``option``, if ``key`` is neither; a secret key's value is redacted.
    """
    shown: object = "<redacted>" if "secret" in option.lower() else key
    if isinstance(key, str):
        try:
            key = key.encode("ascii")
        except UnicodeEncodeError:
            raise ConfigError(option, shown, _EXPECTED) from None
    if isinstance(key, bytes):
        if len(key) == 40:
            try:
                raw = z85.decode(key)
            except (ValueError, KeyError, TypeError):
                raw = b""
            if len(raw) == 32:
                return key
        elif len(key) == 32:
            return z85.encode(key)
    raise ConfigError(option, shown, _EXPECTED)


def require_curve() -> None:
    """Raise TransportError if this libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise TransportError("CURVE requested but this libzmq has no CURVE support")


def key_pair(
    secret_key: str | bytes,
    public_key: str | bytes | None = None,
    *,
    secret_option: str = "curve_secret_key",
    public_option: str = "curve_public_key",
) -> tuple[bytes, bytes]:
    """``(secret, public)`` Z85 keys; the public key is derived, and checked if given.

    Raises
    ------
    TransportError
        If libzmq has no CURVE.
    ConfigError
        If a key is malformed, or ``public_key`` is not the secret key's public key.
    """
    require_curve()
    secret = curve_key(secret_key, secret_option)
    public = zmq.curve_public(secret)
    if public_key is not None and curve_key(public_key, public_option) != public:
        raise ConfigError(public_option, public_key, f"the public key of {secret_option}")
    return secret, public


def apply_server(
    sock: zmq.Socket[bytes], keys: tuple[bytes, bytes] | None, zap_domain: str | None = None
) -> None:
    """Make ``sock`` a CURVE server with ``keys`` (``(secret, public)`` from :func:`key_pair`;
    None: no CURVE) and set its ZAP domain when given."""
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[1])
    if zap_domain is not None:
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode("utf-8"))


def apply_client(sock: zmq.Socket[bytes], server_key: bytes, keys: tuple[bytes, bytes]) -> None:
    """Make ``sock`` a CURVE client of ``server_key`` with our ``(secret, public)`` keys."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys[0])
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[1])


def server_curve(secret_key: str | bytes, public_key: str | bytes | None = None) -> Curve:
    """The :class:`~zio_spark.options.Curve` of a bound (server) port: our key pair, and
    our public key as ``server_key`` (what our clients use). The public key is derived
    from the secret key when omitted, and checked when given.

    Raises
    ------
    TransportError
        If libzmq has no CURVE.
    ConfigError
        If a key is malformed, or ``public_key`` is not the secret key's public key.
    """
    secret, public = key_pair(secret_key, public_key)
    return Curve(server_key=public, public_key=public, secret_key=secret)


def client_curve(
    server_key: str | bytes, secret_key: str | bytes, public_key: str | bytes | None = None
) -> Curve:
    """The :class:`~zio_spark.options.Curve` of a connecting (client) port: the server's
    public key and our key pair (public key derived when omitted, checked when given).

    Raises
    ------
    TransportError, ConfigError
        As :func:`server_curve`.
    """
    secret, public = key_pair(secret_key, public_key)
    return Curve(curve_key(server_key, "curve_server_key"), public, secret)


def optional_server_curve(
    secret_key: str | bytes | None, public_key: str | bytes | None = None
) -> Curve | None:
    """:func:`server_curve` from the optional ``curve_secret_key`` / ``curve_public_key``
    keywords of a user-facing constructor; None (no CURVE) when neither is given.

    Raises
    ------
    ConfigError
        A public key without the secret key, or as :func:`server_curve`.
    TransportError
        As :func:`server_curve`.
    """
    if secret_key is None:
        if public_key is not None:
            raise ConfigError("curve_secret_key", None, "a key whenever curve_public_key is set")
        return None
    return server_curve(secret_key, public_key)


def optional_client_curve(
    server_key: str | bytes | None,
    secret_key: str | bytes | None,
    public_key: str | bytes | None = None,
) -> Curve | None:
    """:func:`client_curve` from the optional ``curve_server_key`` / ``curve_secret_key``
    / ``curve_public_key`` keywords of a user-facing constructor; None (no CURVE) when
    none is given.

    Raises
    ------
    ConfigError
        A client key without the server key, the server key without our secret key, or
        as :func:`client_curve`.
    TransportError
        As :func:`client_curve`.
    """
    if server_key is None:
        if secret_key is not None or public_key is not None:
            raise ConfigError(
                "curve_server_key", None, "the server's public key whenever a client key is set"
            )
        return None
    if secret_key is None:
        raise ConfigError("curve_secret_key", None, "the client's secret key with curve_server_key")
    return client_curve(server_key, secret_key, public_key)


def _pair(curve: Curve) -> tuple[bytes, bytes]:
    return key_pair(
        curve.secret_key,
        curve.public_key,
        secret_option="curve.secret_key",
        public_option="curve.public_key",
    )


def server_keys(curve: Curve | None) -> tuple[bytes, bytes] | None:
    """``(secret, public)`` Z85 keys for a server port from ``curve`` (None: no CURVE).

    Raises
    ------
    TransportError
        If libzmq has no CURVE.
    ConfigError
        If a key is malformed, the public key is not the secret key's, or ``server_key``
        is not the port's own public key (the key its clients are given).
    """
    if curve is None:
        return None
    secret, public = _pair(curve)
    if curve_key(curve.server_key, "curve.server_key") != public:
        raise ConfigError(
            "curve.server_key",
            curve.server_key,
            "a bound port's own public key (curve.public_key), the key its clients use",
        )
    return secret, public


def client_keys(curve: Curve | None) -> tuple[bytes, tuple[bytes, bytes]] | None:
    """``(server key, (secret, public))`` Z85 keys for a client port from ``curve``
    (None: no CURVE).

    Raises
    ------
    TransportError, ConfigError
        If libzmq has no CURVE or a key is malformed (naming ``curve.<field>``).
    """
    if curve is None:
        return None
    return curve_key(curve.server_key, "curve.server_key"), _pair(curve)


class CurveAuthenticator:
    """A running ZAP handler that admits CURVE clients from an allow-list of public keys.

    Built on pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`. One per context (ZAP
    handlers bind ``inproc://zeromq.zap.01``). It applies to every CURVE socket of the
    context whose ZAP domain matches ``domain`` (``"*"``: all). Use :func:`start_authenticator`.

    Besides the allow-list, keys may be *leased*: :meth:`lease` admits a key on behalf of
    an owner (a producer's control flow admitting its query's run key) until
    :meth:`release` of that owner. A key is admitted while it is on the allow-list or
    leased by any owner. The ZAP thread reads one immutable set per handshake; changes
    are made under a lock and take effect at the next handshake (connections already
    made stay up). Leased keys are admitted in every domain the handler answers for,
    unless :meth:`lease_only_in` named some: then only at their handshakes (a queue's
    handler judges its PZQ sockets too, where a query's run key has no business).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        allowed_client_public_keys: Iterable[str | bytes],
        *,
        domain: str = "*",
    ) -> None:
        self._allowed: frozenset[bytes] = frozenset(
            curve_key(k, "allowed_client_public_keys") for k in allowed_client_public_keys
        )
        self.domain = domain
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("zio_spark.transport.zap"))
        self._started = False
        self._lock = threading.Lock()
        self._leases: dict[Hashable, bytes] = {}
        self._leased: frozenset[bytes] = frozenset()
        self._lease_domains: frozenset[str] | None = None  # None: every domain
        self.refused = 0  # handshakes refused (ZAP thread; read for stats)
        # Handshakes admitted, per client key (Z85): who connected with which key.
        self.handshakes: collections.Counter[bytes] = collections.Counter()

    @property
    def allowed(self) -> frozenset[bytes]:
        """The allowed client public keys, Z85."""
        return self._allowed

    def allow(self, *keys: str | bytes) -> None:
        """Add client public keys (takes effect for the next handshake)."""
        new = {curve_key(k, "allowed_client_public_keys") for k in keys}
        self._allowed = self._allowed | new

    def revoke(self, *keys: str | bytes) -> None:
        """Remove client public keys (established connections stay up)."""
        gone = {curve_key(k, "allowed_client_public_keys") for k in keys}
        self._allowed = self._allowed - gone

    @property
    def leased(self) -> frozenset[bytes]:
        """The keys admitted by a lease now, Z85."""
        return self._leased

    def lease(self, owner: Hashable, key: str | bytes) -> None:
        """Admit ``key`` on behalf of ``owner`` until :meth:`release` (an owner holds
        one key: a new lease replaces its old one).

        Raises
        ------
        ConfigError
            If ``key`` is malformed.
        """
        z85_key = curve_key(key, "leased_client_public_key")
        with self._lock:
            self._leases[owner] = z85_key
            self._leased = frozenset(self._leases.values())

    def release(self, owner: Hashable) -> bytes | None:
        """End ``owner``'s lease (no-op without one); returns the key it held. The key
        stays admitted if another owner leases it or it is on the allow-list."""
        with self._lock:
            key = self._leases.pop(owner, None)
            if key is not None:
                self._leased = frozenset(self._leases.values())
        return key

    def lease_only_in(self, domain: str) -> None:
        """Answer for the ZAP ``domain`` too (a socket with
        ``ServerPort(zap_domain=domain)``), and admit leased keys only at handshakes of
        the domains named so (the allow-list stays good everywhere). Call it before
        sockets of ``domain`` take clients (after :meth:`start`).

        Raises
        ------
        ConfigError
            If ``domain`` is empty or ``"*"`` (sockets without a domain: those the
            leases must stay out of).
        """
        if not isinstance(domain, str) or domain in ("", "*"):
            raise ConfigError("domain", domain, "a ZAP domain name of its own, not '' or '*'")
        if not self._started:
            raise ConfigError("domain", domain, "a started handler (call start() first)")
        self._auth.configure_curve_callback(domain, credentials_provider=self)
        with self._lock:
            self._lease_domains = frozenset({*(self._lease_domains or ()), domain})

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: ``key`` is the client's Z85 public key."""
        domains = self._lease_domains
        ok = key in self._allowed or (
            key in self._leased and (domains is None or domain in domains)
        )
        if ok:
            self.handshakes[key] += 1
        else:
            self.refused += 1
            log.warning(
                "CURVE client key %s refused (ZAP domain %r): not in the allow-list",
                key.decode("ascii", "replace"),
                domain,
            )
        return ok

    def start(self) -> CurveAuthenticator:
        """Start the ZAP thread.

        Raises
        ------
        TransportError
            If another ZAP handler already runs on this context.
        """
        if self._started:
            return self
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            self._auth.stop()
            raise TransportError(
                f"cannot start the ZAP authenticator: {e} (only one per context)",
                endpoint="inproc://zeromq.zap.01",
            ) from e
        self._auth.configure_curve_callback(self.domain, credentials_provider=self)
        self._started = True
        return self

    def stop(self) -> None:
        """Stop the ZAP thread; idempotent. Do this before terminating the context."""
        if self._started:
            self._started = False
            self._auth.stop()

    def __enter__(self) -> CurveAuthenticator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_authenticator(
    ctx: zmq.Context[zmq.Socket[bytes]],
    allowed_client_public_keys: Iterable[str | bytes],
    *,
    domain: str = "*",
) -> CurveAuthenticator:
    """Start a ZAP handler on ``ctx`` admitting only the given CURVE client keys.

    Parameters
    ----------
    ctx
        The context of the CURVE server ports to protect.
    allowed_client_public_keys
        Client public keys, Z85 text or 32 raw bytes.
    domain
        ZAP domain to answer for (``"*"``: any; else match ``ServerPort(zap_domain=...)``).

    Returns
    -------
    CurveAuthenticator
        Running; call ``stop()`` (or use it as a context manager) before ``ctx.term()``.

    Raises
    ------
    ConfigError
        If a key is malformed.
    TransportError
        If a ZAP handler already runs on this context.
    """
    return CurveAuthenticator(ctx, allowed_client_public_keys, domain=domain).start()
