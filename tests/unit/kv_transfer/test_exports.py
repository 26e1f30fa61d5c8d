"""``ExportLedger``: a prefill worker's blocks go back to its engine exactly when every
lease on them has ended (rank 0's and each other rank's), once, and never while a
newer export of the same request holds them."""

from __future__ import annotations

from splitserve.kv_transfer.exports import ExportLedger
from splitserve.wire.kv import LeaseEnd, TransferState

CONFIRMED, EXPIRED, RELEASED = TransferState.CONFIRMED, TransferState.EXPIRED, TransferState.RELEASED


def end(transfer: str, request: str, state: TransferState = CONFIRMED) -> LeaseEnd:
    return LeaseEnd(transfer, request, (0, 1), state)


def test_one_rank_a_confirmed_lease_gives_the_blocks_back_once():
    ledger = ExportLedger()
    ledger.opened("r", "t")
    assert ledger.transfer("r") == "t" and ledger.held() == {"r"}
    assert ledger.take_released() == []  # nothing ended yet
    assert ledger.ended(end("t", "r")) is False
    assert ledger.transfer("r") is None  # abort has nothing to release now
    assert ledger.take_released() == ["r"]
    assert ledger.take_released() == [] and ledger.held() == set()
    assert ledger.lease_ends == {CONFIRMED: 1, EXPIRED: 0, RELEASED: 0}


def test_the_end_of_a_replaced_export_changes_nothing():
    """A streamed export given up when its step failed, then exported again: the old
    transfer's end must not free the blocks the new one holds."""
    ledger = ExportLedger()
    ledger.opened("r", "old")
    ledger.opened("r", "new")
    assert ledger.ended(end("old", "r", RELEASED)) is False
    assert ledger.take_released() == [] and ledger.transfer("r") == "new"
    ledger.ended(end("new", "r", EXPIRED))
    assert ledger.take_released() == ["r"]
    assert ledger.lease_ends == {CONFIRMED: 0, EXPIRED: 1, RELEASED: 1}


def test_a_tp_group_waits_for_every_shard():
    ledger = ExportLedger()
    ledger.opened("r", "t")
    ledger.shards_opened("r", range(1, 3))
    assert ledger.shards_open
    assert ledger.ended(end("t", "r")) is False  # confirmed: the shards end on their own
    assert ledger.take_released() == [] and ledger.held() == {"r"}
    ledger.shards_ended(1, ["r", "unknown"])
    assert ledger.take_released() == []
    ledger.shards_ended(2, ["r"])
    assert ledger.take_released() == ["r"]
    assert not ledger.shards_open and ledger.held() == set()


def test_shards_that_end_first_wait_for_rank_0():
    ledger = ExportLedger()
    ledger.opened("r", "t")
    ledger.shards_opened("r", [1])
    ledger.shards_ended(1, ["r"])
    assert ledger.take_released() == []  # rank 0's lease is still open
    ledger.ended(end("t", "r"))
    assert ledger.take_released() == ["r"]


def test_rank_0_ending_unconfirmed_releases_the_shards_too():
    """Expired or released (aborted) on rank 0 while the shards' leases are open: the
    worker is told to release them, and the blocks go back at once."""
    for state in (EXPIRED, RELEASED):
        ledger = ExportLedger()
        ledger.opened("r", "t")
        ledger.shards_opened("r", [1, 2, 3])
        assert ledger.ended(end("t", "r", state)) is True
        assert ledger.take_released() == ["r"]
        assert not ledger.shards_open


def test_requests_are_released_independently_in_the_order_their_leases_ended():
    ledger = ExportLedger()
    for r in "abc":
        ledger.opened(r, f"t{r}")
    ledger.ended(end("tc", "c"))
    ledger.ended(end("ta", "a", EXPIRED))
    assert ledger.take_released() == ["c", "a"]
    assert ledger.held() == {"b"}
