"""Signed webhooks: the signature a receiver verifies, and one delivery attempt over HTTP(S).

The signature is Stripe's scheme with our header's name. Each request carries

    Ratelimits-Signature: t=1733560000,v1=5257a869e7ecebeda32affa62cdca3fa51cad7e77a0e56ff536d0ce8e108d8bd

where ``v1`` is the hex HMAC-SHA256, keyed with the endpoint's secret, of the timestamp, a ``.``
and the raw body. The timestamp is signed, so a receiver that refuses old ones
(:data:`TOLERANCE_S`) refuses a replayed delivery. :func:`verify` accepts any one of several
``v1`` (room for signing with two secrets while one is replaced); it is what a Python receiver
calls, and the scheme is short enough to write in any language (docs/notices.md).

:func:`post` sends one attempt. It follows no redirect (a receiver's 3xx is its answer) and, unless
told otherwise, refuses an address that is loopback, private, link-local or otherwise not public
once resolved, and connects to the address it checked: a customer's URL must not reach the fleet's
own services, even by a DNS name that changes its answer between the check and the connection.

This module imports nothing of Django's: a receiver may use :func:`verify` alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

__all__ = [
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TOLERANCE_S",
    "Attempt",
    "UnsafeURL",
    "check_url",
    "post",
    "sign",
    "verify",
]

#: The header a delivery's signature travels in.
SIGNATURE_HEADER = "Ratelimits-Signature"
#: The header naming the event a delivery carries: the same on every attempt, for a receiver to
#: drop a second delivery of an event it already has.
EVENT_HEADER = "Ratelimits-Event"
#: How old a signed timestamp :func:`verify` accepts by default, in seconds (either way: clocks drift).
TOLERANCE_S = 300
#: What a delivery reads of a receiver's answer: its status is what counts.
_MAX_ANSWER = 64 * 1024


def sign(secret: str, body: bytes, *, timestamp: int) -> str:
    """``Ratelimits-Signature``'s value for ``body`` sent at ``timestamp`` (unix seconds)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: str, body: bytes, header: str, *, tolerance_s: float = TOLERANCE_S, now: float | None = None
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret``, at a time within ``tolerance_s`` of now.

    ``body`` is the request's raw body, as received (not parsed and dumped again). Any one of
    several ``v1`` may match; a header that cannot be read is ``False``, never an exception.
    """
    stamp: int | None = None
    macs: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t" and value.isascii() and value.isdigit() and len(value) <= 12:
            stamp = int(value)
        elif name == "v1" and value.isascii():
            macs.append(value)
    if stamp is None or not macs:
        return False
    if abs((time.time() if now is None else now) - stamp) > tolerance_s:
        return False
    expected = sign(secret, body, timestamp=stamp).rpartition("v1=")[2]
    return any(hmac.compare_digest(expected, mac) for mac in macs)


class UnsafeURL(ValueError):
    """A webhook URL that is no ``http(s)`` URL, or that leads to an address that is not public."""


def check_url(url: str, *, allow_private: bool = False, resolve: bool = True) -> tuple[urllib.parse.SplitResult, str]:
    """``url`` split, and the address to connect to (the first its host resolves to).

    Raises :class:`UnsafeURL` for a URL that is not ``http`` or ``https`` with a host, that carries
    credentials, or (unless ``allow_private``) whose host resolves to any address that is not
    public: one private answer among public ones is a host that can be steered inside. With
    ``resolve=False`` (a form's check: the name may not resolve from here), only a host written as
    an address, or ``localhost``, is checked, and the host is given back as the address.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"{url!r} is not an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise UnsafeURL(f"{url!r} carries credentials: the endpoint's secret signs each delivery instead")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeURL(f"{url!r}: {exc}") from None
    host = parts.hostname
    if not resolve:
        if not allow_private and (host == "localhost" or host.endswith(".localhost") or _written_private(host)):
            raise UnsafeURL(f"{host!r} is not a public address")
        return parts, host
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UnsafeURL(f"{host!r} does not resolve: {exc}") from None
    addresses = [str(info[4][0]) for info in found]
    if not allow_private:
        for address in addresses:
            if not _public(ipaddress.ip_address(address.split("%", 1)[0])):
                raise UnsafeURL(f"{host!r} resolves to {address}, which is not a public address")
    return parts, addresses[0]


def _written_private(host: str) -> bool:
    try:
        return not _public(ipaddress.ip_address(host))
    except ValueError:
        return False  # a name: checked once resolved, when sent to


#: IPv6 prefixes that carry an IPv4 address inside (NAT64's well-known prefix, and the local one).
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is a public unicast address, and so is any IPv4 address it carries inside
    (mapped, 6to4, Teredo, NAT64): those lead where the IPv4 address does."""
    if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
        if any(ip in network for network in _NAT64):
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(_public(address) for address in inner if address is not None)
    return True


@dataclass(frozen=True, slots=True)
class Attempt:
    """What came of one delivery attempt: the receiver's status (``None``: no answer) and why it failed."""

    status: int | None
    error: str = ""
    #: How long the attempt took, in milliseconds.
    took_ms: int = 0

    @property
    def delivered(self) -> bool:
        """A 2xx: the receiver has it. Anything else is tried again (a 4xx too: a receiver being deployed)."""
        return self.status is not None and 200 <= self.status < 300


def post(
    url: str,
    secret: str,
    body: bytes,
    *,
    event: str,
    timeout_s: float = 5.0,
    allow_private: bool = False,
    now: float | None = None,
) -> Attempt:
    """POST ``body`` (JSON) to ``url``, signed with ``secret``, as one attempt to deliver ``event``.

    Never raises for the receiver's trouble or a URL it refuses: that is an attempt that failed.
    """
    started = time.monotonic()
    stamp = int(time.time() if now is None else now)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "ratelimits-webhooks",
        SIGNATURE_HEADER: sign(secret, body, timestamp=stamp),
        EVENT_HEADER: event,
    }

    def took() -> int:
        return int((time.monotonic() - started) * 1000)

    try:
        parts, address = check_url(url, allow_private=allow_private)
        connection = _connection(parts, address, timeout_s)
        # One deadline for the whole attempt: the socket's timeout bounds each read, and a receiver
        # that drips its answer a byte at a time is cut off when the attempt's time is up.
        cut = threading.Event()
        deadline = started + timeout_s
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _cut, [connection, cut])
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request("POST", _target(parts), body=body, headers=headers)
            answer = connection.getresponse()
            answer.read(_MAX_ANSWER)
            status = answer.status
            answered_in_time = time.monotonic() < deadline
        finally:
            watchdog.cancel()
            connection.close()
        if cut.is_set() and not answered_in_time:  # what was read before the cut is no answer
            return Attempt(None, f"no whole answer within {timeout_s:g} s", took())
    except UnsafeURL as exc:
        return Attempt(None, f"refused: {exc}", took())
    except Exception as exc:  # the receiver's trouble, whatever its form, is an attempt that failed
        return Attempt(None, f"{type(exc).__name__}: {exc}", took())
    return Attempt(status, "" if 200 <= status < 300 else f"HTTP {status}", took())


def _target(parts: urllib.parse.SplitResult) -> str:
    """The request's path and query, percent-encoded where the URL was typed with other characters."""
    target = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        target += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return target


def _cut(connection: http.client.HTTPConnection, cut: threading.Event) -> None:
    """End an attempt past its deadline: shutting the socket down wakes a read blocked on it."""
    cut.set()
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _connection(parts: urllib.parse.SplitResult, address: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to ``address`` (the one :func:`check_url` checked) that names the URL's host:
    in ``Host``, and for HTTPS in SNI and the certificate's check."""
    host = parts.hostname or ""
    if parts.scheme == "https":
        return _PinnedHTTPS(host, address, parts.port or 443, timeout_s)
    return _PinnedHTTP(host, address, parts.port or 80, timeout_s)


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, address: str, port: int, timeout_s: float) -> None:
        super().__init__(host, port, timeout=timeout_s)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, address: str, port: int, timeout_s: float) -> None:
        super().__init__(host, port, timeout=timeout_s, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
