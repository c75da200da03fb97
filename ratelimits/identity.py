"""Who is making a request: the subjects (user, API key, client IP, organisation, endpoint)."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ._memo import memoize, remember
from .conf import conf

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "Identity",
    "Subject",
    "SubjectKind",
    "client_ip",
    "django_request",
    "identify",
    "normalize_ip",
    "request_method",
    "subject_of",
]

logger = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def django_request(request: Any) -> HttpRequest:
    """The Django request behind ``request``: itself, or the one a DRF ``Request`` wraps.

    DRF's ``Request`` proxies every attribute it does not have itself to Django's, at about half a
    microsecond a read (two for one Django's does not have either): the decision path reads
    ``META``, ``method`` and ``path_info`` from Django's own.
    """
    http: HttpRequest = getattr(request, "_request", request)
    return http


def request_method(request: Any) -> str:
    """``request``'s method (``"GET"`` if it has none), read without DRF's proxy.

    A DRF ``Request`` made by ``clone_request`` (the browsable API, ``OPTIONS`` metadata) carries
    a method of its own, which beats Django's.
    """
    method: str | None = vars(request).get("method") or django_request(request).method
    return method or "GET"


@memoize
def _digest(key: bytes, kind: str, value: str) -> str:
    raw = hashlib.blake2b(f"{kind}\x00{value}".encode("utf-8", "surrogatepass"), digest_size=12, key=key).digest()
    return base64.urlsafe_b64encode(raw).decode("ascii")


class SubjectKind(StrEnum):
    """What a subject is. The first four are callers' identities that policies can be assigned to."""

    API_KEY = "api_key"
    USER = "user"
    ORG = "org"
    IP = "ip"
    #: An endpoint as a whole: what its all-callers limit counts.
    ENDPOINT = "endpoint"
    #: The whole fleet: what the load shedder's in-flight set counts.
    FLEET = "fleet"
    #: The first characters of a presented credential: what the failed-authentication limit counts.
    CREDENTIAL = "credential"
    #: What a view's own limit counts by, when it is not the client IP or the user
    #: (``ratelimits.decorators.ratelimit``'s ``key``: a header, a query or form parameter, a function's).
    KEY = "key"

    @property
    def label(self) -> str:
        return _KIND_LABELS[self]


_KIND_LABELS = {
    SubjectKind.API_KEY: "API key",
    SubjectKind.USER: "user",
    SubjectKind.ORG: "organisation",
    SubjectKind.IP: "IP address or network",
    SubjectKind.ENDPOINT: "endpoint",
    SubjectKind.FLEET: "fleet",
    SubjectKind.CREDENTIAL: "credential prefix",
    SubjectKind.KEY: "view limit key",
}
#: The kinds a tier can be assigned to and an override can name (the callers' identities).
ASSIGNABLE_KINDS = (SubjectKind.API_KEY, SubjectKind.USER, SubjectKind.ORG, SubjectKind.IP)


@dataclass(frozen=True, slots=True)
class Subject:
    """One dimension a request can be limited by, such as ``Subject(SubjectKind.IP, "203.0.113.7")``."""

    kind: SubjectKind
    value: str
    _digest: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.kind) is not SubjectKind:  # a plain string ("ip"): checked, and made the enum
            object.__setattr__(self, "kind", SubjectKind(self.kind))

    @property
    def digest(self) -> str:
        """A keyed, fixed-length hash of the subject: what Redis key names and logs carry.

        Keyed with a secret so a key name cannot be reversed by hashing every IPv4 address,
        and made of ``[A-Za-z0-9_-]`` only, so no ``{`` from user input can steer a key to
        another Redis Cluster slot.
        """
        if not self._digest:
            object.__setattr__(self, "_digest", _digest(conf.identity.hash_key, self.kind, self.value))
        return self._digest

    def __str__(self) -> str:
        return f"{self.kind}:{self.digest}"


#: Subjects made by :func:`subject_of`, by kind, value and the hash key of their digest.
_subjects: dict[tuple[SubjectKind, str, bytes], Subject] = {}


def subject_of(kind: SubjectKind, value: str) -> Subject:
    """``Subject(kind, value)`` with its digest, made once and then handed out again.

    The same callers come back request after request: the made subject carries its digest, so
    neither the object nor the hash is made again. Bounded like the memos above.
    """
    return _subject(kind, value, conf.identity.hash_key)


def _subject(kind: SubjectKind, value: str, hash_key: bytes) -> Subject:
    """:func:`subject_of` under ``hash_key`` (the one in the settings: a request's subjects read it once)."""
    key = (kind, value, hash_key)
    try:
        return _subjects[key]
    except KeyError:
        pass
    made = Subject(kind, value)
    made.digest  # noqa: B018  (computed now, with the hash key it is filed under)
    return remember(_subjects, key, made)


@dataclass(frozen=True, slots=True)
class Identity:
    """Every subject of one request; absent ones are ``None``."""

    ip: Subject
    endpoint: Subject
    user: Subject | None = None
    api_key: Subject | None = None
    organization: Subject | None = None

    @property
    def caller(self) -> Subject:
        """The most specific subject: API key, else user, else client IP."""
        return self.api_key or self.user or self.ip

    @property
    def is_anonymous(self) -> bool:
        return self.api_key is None and self.user is None

    def subjects(self) -> Iterable[Subject]:
        for subject in (self.api_key, self.user, self.organization, self.ip, self.endpoint):
            if subject is not None:
                yield subject

    def subject(self, kind: SubjectKind) -> Subject | None:
        """This request's subject of ``kind`` (``None`` if it has none)."""
        if kind is SubjectKind.IP:
            return self.ip
        if kind is SubjectKind.API_KEY:
            return self.api_key
        if kind is SubjectKind.USER:
            return self.user
        if kind is SubjectKind.ORG:
            return self.organization
        if kind is SubjectKind.ENDPOINT:
            return self.endpoint
        return None


def identify(request: HttpRequest, *, endpoint: str, auth: Any = None, user: Any = None) -> Identity:
    """Build the :class:`Identity` of ``request``.

    ``auth`` and ``user`` are what the authentication layer established (DRF's
    ``request.auth`` and ``request.user``); for plain Django views ``user`` is
    ``request.user`` and ``auth`` is ``None``.
    """
    settings = conf.identity
    user_pk = str(user.pk) if user is not None and getattr(user, "is_authenticated", False) else None
    named_key = settings.api_key_func(auth) if auth is not None else None
    named_organization = settings.organization_func(request)
    api_key = None if named_key is None else str(named_key)
    organization = None if named_organization is None else str(named_organization)
    ip, hash_key = client_ip(request), settings.hash_key
    # A caller's requests come back with the same values: their identity is made once (each
    # subject is made once anyway, and an identity holds nothing else).
    values = (ip, endpoint, user_pk, api_key, organization, hash_key)
    try:
        return _identities[values]
    except KeyError:
        pass
    made = Identity(
        _subject(SubjectKind.IP, ip, hash_key),
        _subject(SubjectKind.ENDPOINT, endpoint, hash_key),
        None if user_pk is None else _subject(SubjectKind.USER, user_pk, hash_key),
        None if api_key is None else _subject(SubjectKind.API_KEY, api_key, hash_key),
        None if organization is None else _subject(SubjectKind.ORG, organization, hash_key),
    )
    return remember(_identities, values, made)


#: (ip, endpoint, user, API key, organisation, hash key) -> the identity made of them.
_identities: dict[tuple[str, str, str | None, str | None, str | None, bytes], Identity] = {}


def default_api_key(auth: Any) -> str | None:
    """What identifies the credential DRF authenticated with.

    Model instances (DRF's ``Token``, most API key models) are identified by class and primary
    key; anything else by its string form. Whatever it is, it is hashed before use.
    """
    pk = getattr(auth, "pk", None)
    if pk is not None:
        return f"{type(auth).__name__}:{pk}"
    text = str(auth)
    return text or None


def no_api_key(auth: Any) -> str | None:
    """An ``IDENTITY['API_KEY_FUNC']`` that names no credential: callers are counted by user, else address.

    For authentication whose credentials are not the caller (a JWT, renewed every few minutes):
    the user it authenticates is, as DRF's ``UserRateThrottle`` counted.
    """
    return None


def no_organization(request: HttpRequest) -> str | None:
    """The default organisation function: requests belong to no organisation."""
    return None


def client_ip(request: HttpRequest) -> str:
    """The client's address as a limiting subject.

    ``REMOTE_ADDR`` unless it is a configured trusted proxy; then the forwarded-for header is
    walked from the right, skipping trusted proxies, and the first other hop is the client.
    A malformed hop stops the walk at the last address we can vouch for, so a forged header
    can neither raise an error nor hand its sender a fresh bucket per request.
    IPv6 addresses are aggregated to a network (``/64`` by default), since one host usually
    owns a whole /64; IPv4-mapped IPv6 addresses become IPv4.
    """
    meta = django_request(request).META
    remote_addr = meta.get("REMOTE_ADDR", "")
    trusted = conf.identity.trusted_proxies
    prefix = conf.identity.ipv6_prefix
    if not trusted:
        return _subject_of(remote_addr, prefix)
    remote = normalize_ip(remote_addr)
    if remote is None:
        return "unknown"
    if not _in_any(remote, trusted):
        return _aggregate(remote, prefix)
    client = remote
    header = meta.get(conf.identity.client_ip_header, "")
    hops = header.split(",") if isinstance(header, str) else []
    for raw in reversed(hops):
        hop = normalize_ip(raw)
        if hop is None:
            logger.debug("ratelimits: malformed forwarded hop, using %s", client)
            break
        client = hop
        if not _in_any(hop, trusted):
            break
    return _aggregate(client, prefix)


@memoize
def _subject_of(remote_addr: str, prefix: int) -> str:
    address = normalize_ip(remote_addr)
    return "unknown" if address is None else _aggregate(address, prefix)


def normalize_ip(raw: str) -> Address | None:
    """Parse one address as proxies write it (optional port, brackets, zone); ``None`` if invalid."""
    text = raw.strip()
    # Checked before the memo, so oversized junk from a header can never fill it.
    if not text or len(text) > 64:
        return None
    return _parse_address(text)


@memoize
def _parse_address(text: str) -> Address | None:
    if text.startswith("["):
        end = text.find("]")
        if end == -1:
            return None
        text = text[1:end]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    text = text.split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _in_any(address: Address, networks: tuple[IPNetwork, ...]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


def _aggregate(address: Address, prefix: int) -> str:
    if isinstance(address, ipaddress.IPv6Address) and prefix < 128:
        return str(ipaddress.IPv6Network((address, prefix), strict=False))
    return str(address)
