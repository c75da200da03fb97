"""The decision value: an admission made by the fast path is the dataclass's own, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from ratelimits.decisions import Decision, Result, Verdict, admitted
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies.values import Check, Policy
from ratelimits.rates import parse_rate

CHECK = Check(Policy("p", parse_rate("5/s"), 5), Subject(SubjectKind.IP, "198.51.100.1"))
SHADOW = Check(Policy("s", parse_rate("1/s"), 1, shadow=True), Subject(SubjectKind.IP, "198.51.100.1"))


@pytest.mark.parametrize(
    "made",
    [
        lambda: ((Result(CHECK, True, 4, 200_000, 0),), 1_700_000_000_000_000, "7", "slot-1", ("k1", "k2"), None),
        lambda: ((), 5, None, None, (), None),
        lambda: ((Result(CHECK, True, 9, 1_000, 0),), 6, None, None, (), "lease"),  # memory's, from a lease
    ],
)
def test_an_admission_made_without_the_dataclass_init_is_the_same_decision(made: object) -> None:
    """``admitted`` sets every field ``Decision``'s own ``__init__`` sets, to the same values: a
    field added to the class and not to it fails here (an unset slot cannot be read)."""
    results, now_us, version, slot, keys, local = made()  # type: ignore[operator]
    fast = admitted(results, now_us, version, slot, keys, local)
    made_by_init = Decision(Verdict.ALLOW, results, 0, now_us, False, version, slot, keys, None, local)
    assert type(fast) is Decision
    for field in dataclasses.fields(Decision):
        assert getattr(fast, field.name) == getattr(made_by_init, field.name), field.name
    assert fast == made_by_init and hash(fast) == hash(made_by_init)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.verdict = Verdict.LIMITED  # type: ignore[misc]


def test_results_combine_as_before_whichever_way_the_decision_is_made() -> None:
    """``from_results``: all allowed (a shadow denial included) is an admission, made the fast way;
    an enforced denial is a 429 with the longest wait, and nothing of a slot."""
    allowed = Result(CHECK, True, 4, 200_000, 0)
    shadow_denied = Result(SHADOW, False, 0, 1_000_000, 1_000_000)
    admission = Decision.from_results([allowed, shadow_denied], now_us=9, slot="s", slot_keys=("k",))
    assert admission == Decision(Verdict.ALLOW, (allowed, shadow_denied), 0, 9, False, None, "s", ("k",))
    assert admission.shadow_violated == (shadow_denied,) and admission.violated == ()
    denied = Result(CHECK, False, 0, 400_000, 200_000)
    refusal = Decision.from_results([denied, shadow_denied], now_us=9, slot="s", slot_keys=("k",))
    assert (refusal.verdict, refusal.retry_after_us, refusal.slot) == (Verdict.LIMITED, 200_000, None)
    assert refusal.violated == (denied,) and refusal.shadow_violated == (shadow_denied,)
    degraded = Decision.from_results([allowed], now_us=9, degraded=True)
    assert degraded.degraded and degraded.allowed
