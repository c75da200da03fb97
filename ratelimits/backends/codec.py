"""The Redis scripts' wire format: the packed records a decide call sends and reads, and its states.

``lua/decide.lua`` is the other half of every layout here (its ``REQUEST``, ``CHECK``,
``FALLBACK``, ``REFUNDABLE``, ``LEASE`` and state layouts); ``tests/test_scripts.py`` holds the
two to the same formats. Numbers travel as little-endian IEEE doubles: the script unpacks them
with one copy, where parsing decimal strings is the costliest thing a script does. Only the Redis
backends use this module: the policies and the memory backend carry no packed bytes.
"""

from __future__ import annotations

import struct

from .._memo import remember
from ..algorithms import Algorithm, State
from ..policies.values import Check

__all__ = [
    "CHECK",
    "DEADLINE",
    "LEASE",
    "OLD_WINDOW_FORMATS",
    "PERIOD",
    "REFUNDABLE",
    "REFUNDED_STATE",
    "REFUND_CHECK",
    "REFUND_NOW",
    "REQUEST",
    "STATE_FORMATS",
    "TIMED_STATE",
    "check_record",
    "read_state",
]

#: A decide call's request header (``REQUEST`` in ``lua/decide.lua``): now (negative: the script
#: reads Redis ``TIME``), the mode (0 peek, 1 consume, 2 refundable, 3 leasing), the tokens the
#: request spends, the usage hashes' TTL (s), the most rows a minute counts, the number of global
#: checks, the overflow row's length in bytes, and last, the deadline (us, Redis TIME; 0: none),
#: which :data:`DEADLINE` rewrites as the call is sent. The checks' records follow, then the
#: overflow row and the request's slot id, read only when a request needs them.
REQUEST = struct.Struct("<dBdddddd")
#: The request header's last field: the call's deadline.
DEADLINE = struct.Struct("<d")
#: A check's record (``CHECK``): algorithm code, flags (1: shadow; 2: a global policy; 4: a quota by
#: billing period; 8: soft, admitting past its limit), limit, period (us), burst, cost, and the state
#: TTL (ms, for ``PX``); a global policy's adds ``FALLBACK``: its share in a region without a share
#: record; a billing period's is followed, per request, by ``PERIOD``.
CHECK = struct.Struct("<BBddddd")
_FALLBACK = struct.Struct("<d")
_GLOBAL_FLAG, _PERIOD_FLAG, _SOFT_FLAG = 2, 4, 8
#: A billing period's three starts around now (us; ``PERIOD`` in ``lua/decide.lua``): the request's
#: own part of a quota's record (:meth:`ratelimits.periods.BillingPeriod.bounds`).
PERIOD = struct.Struct("<ddd")
#: ``lua/refund.lua``'s header (now) and each check's record before what the decide call reported.
REFUND_NOW = struct.Struct("<d")
REFUND_CHECK = struct.Struct("<Bddddd")
#: A refundable decide call's report per check (``REFUNDABLE``: what a refund needs, passed on as
#: it came), and a leasing one's wants and grants (``LEASE``: tokens).
REFUNDABLE = struct.Struct("<dd")
LEASE = struct.Struct("<d")

#: Check id -> (check, its record). An entry holds its check, so the id stays its own; a caller's
#: checks are the same objects request after request (:func:`~ratelimits.policies.values.check_for`).
_records: dict[int, tuple[Check, bytes]] = {}


def check_record(check: Check) -> bytes:
    """``check``'s record for the decide script, packed once per check."""
    try:
        return _records[id(check)][1]
    except KeyError:
        pass
    policy = check.policy
    flags = policy.shadow | (_GLOBAL_FLAG if policy.is_global else 0)
    if policy.period is not None:
        flags |= _PERIOD_FLAG | (_SOFT_FLAG if policy.soft else 0)
    record = CHECK.pack(
        policy.algorithm.code,
        flags,
        policy.rate.limit,
        policy.rate.period_us,
        policy.burst,
        check.cost,
        policy.state_ttl_ms,
    )
    if policy.is_global:
        record += _FALLBACK.pack(policy.even_share)
    return remember(_records, id(check), (check, record))[1]


#: How ``lua/decide.lua`` packs each rate algorithm's state (``GCRA_STATE`` and the others there),
#: with the terms it was written in, and how the windows' previous layouts did, without them.
STATE_FORMATS = {
    Algorithm.TOKEN_BUCKET: struct.Struct("<dd"),
    Algorithm.SLIDING_WINDOW: struct.Struct("<ddddd"),
    Algorithm.FIXED_WINDOW: struct.Struct("<dddd"),
}
OLD_WINDOW_FORMATS = {
    Algorithm.SLIDING_WINDOW: struct.Struct("<ddd"),
    Algorithm.FIXED_WINDOW: struct.Struct("<dd"),
}
#: A token bucket a refund gave back to: its arrival time, capacity, the us given back so far, and a
#: byte of 255 (``REFUNDED_STATE`` in ``lua/decide.lua``); then 16 bytes per hole (``lua/refund.lua``).
REFUNDED_STATE = struct.Struct("<dddB")
#: A token bucket's state with when its key expires (``TIMED_STATE`` in ``lua/decide.lua``).
TIMED_STATE = struct.Struct("<ddd")


def read_state(algorithm: Algorithm, value: bytes) -> State:
    """A state value as the decide script stored it, read back (for tests and for looking into Redis).

    The same tuples :mod:`ratelimits.algorithms` takes: a token bucket's ``(theoretical arrival
    time, capacity)``, a sliding window's ``(window index, current count, previous count, limit,
    period)``, a fixed window's ``(window index, count, limit, period)``. A window value of the
    previous layout reads without its terms (``(window, current, previous)``, ``(window, count)``),
    as the script reads it.
    """
    if algorithm is Algorithm.TOKEN_BUCKET and len(value) % 16 == REFUNDED_STATE.size % 16:  # a refund gave back to it
        return REFUNDED_STATE.unpack_from(value)[:2]
    if algorithm is Algorithm.TOKEN_BUCKET and len(value) == TIMED_STATE.size:  # with its key's expiry
        return TIMED_STATE.unpack(value)[:2]
    layout = STATE_FORMATS[algorithm]
    return (layout if len(value) == layout.size else OLD_WINDOW_FORMATS[algorithm]).unpack(value)
