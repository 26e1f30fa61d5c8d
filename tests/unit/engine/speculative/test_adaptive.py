"""``speculative.adaptive.Acceptance``: a request proposes more while its drafts are
kept, fewer as they are rejected, none but a probe when they never are."""

from __future__ import annotations

from splitserve.engine.speculative.adaptive import MAX_PROBE_EVERY, PROBE_EVERY, Acceptance

GAIN = 0.3


def test_k_rises_to_the_cap_while_drafts_are_kept():
    a = Acceptance(max_k=4)
    start = a.k(GAIN)
    assert 0 < start < 4
    for _ in range(20):
        k = a.k(GAIN)
        a.record(k, k)
    assert a.k(GAIN) == 4
    assert a.rate > 0.9


def test_k_falls_to_probes_when_drafts_are_rejected():
    a = Acceptance(max_k=4)
    while a.k(GAIN):
        a.record(a.k(GAIN), 0)
    ks = [a.k(GAIN) for _ in range(3 * PROBE_EVERY)]
    assert ks.count(1) == 3 and set(ks) == {0, 1}  # one probe token every PROBE_EVERY steps


def test_probes_rejected_come_ever_rarer_and_one_kept_restores_them():
    a = Acceptance(max_k=4)
    while a.k(GAIN):
        a.record(a.k(GAIN), 0)
    gaps, idle = [], 0
    for _ in range(PROBE_EVERY * 30):  # 8 + 16 + 32 + 64 + 64 ... steps apart
        idle += 1
        if a.k(GAIN):
            gaps.append(idle)
            idle = 0
            a.record(1, 0)
    # (the first gap counts from a step already idle)
    assert gaps[1:5] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_PROBE_EVERY, MAX_PROBE_EVERY]
    while not a.k(GAIN):
        pass
    a.record(1, 1)  # the text turned copyable: the next probe comes PROBE_EVERY steps on
    assert [a.k(GAIN) for _ in range(PROBE_EVERY)].count(0) < PROBE_EVERY


def test_a_draft_token_dearer_than_a_decode_token_is_never_proposed_not_even_as_a_probe():
    """No acceptance rate below 1 pays for a draft token that costs a decode token or
    more, so a proposer that expensive does not probe; cheaper again, it does."""
    a = Acceptance(max_k=4)
    assert [a.k(1.0) for _ in range(10 * MAX_PROBE_EVERY)] == [0] * (10 * MAX_PROBE_EVERY)
    assert 1 in [a.k(0.99) for _ in range(PROBE_EVERY)]


def test_a_text_that_turns_copyable_is_seen_by_the_probes():
    a = Acceptance(max_k=4)
    for _ in range(30):
        a.record(1, 0)
    for _ in range(10 * PROBE_EVERY):
        k = a.k(GAIN)
        if k:
            a.record(k, k)
    assert a.k(GAIN) >= 2


def test_the_counts_are_what_was_recorded():
    a = Acceptance(max_k=4)
    a.record(4, 1)
    a.record(2, 2)
    a.record(0, 0)  # nothing proposed: not a verified step
    assert (a.proposed, a.accepted, a.steps) == (6, 3, 2)
