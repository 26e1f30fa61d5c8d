"""Handoff faults through the cluster, CI-size (``bench.cluster_faults``; the full list runs in
``python -m splitserve.bench.handoff_faults``): a prefill and a decode worker as Ray
actors, KV over NIXL, every handoff checked by meaning. One fault at a time, armed on
the worker where such a bug strikes, each caught by the check that should catch it
(the source's bytes changed after hashing: the checksums; a pull past its lease: the
lease; right bytes in the wrong place: the meaning check), the request recomputed to
the monolithic engine's tokens, no block held afterwards, and the trace's mark naming
both workers and the error."""

from __future__ import annotations

import pytest

from splitserve.bench import cluster_faults as cf
from splitserve.wire.faults import HandoffFault as F
from splitserve.wire.sampling import SamplingParams
from tests.integration.cluster_util import live_cluster

SETUP = cf.Setup(
    "Llama float32",
    "llama",
    faults=(
        F.SOURCE_BYTES_CHANGED,
        F.PULL_AFTER_LEASE,
        F.BLOCK_TABLE_PERMUTED,
        F.LAYERS_SWAPPED,
        F.KV_HEADS_SWAPPED,
    ),
)
EXPECTED = {"source": "checksum", "pull": "lease", "sink": "meaning"}


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(SETUP.config(checkpoint, verify_meaning=1.0)) as c:
        yield c


def test_each_fault_is_caught_by_its_check_and_recomputed_to_the_engines_tokens(cluster, checkpoint):
    faults = (None, *SETUP.faults, None)  # a correct handoff before and after the faults
    prompts = cf.prompts_for(len(faults), vocab=512)
    want = cf.reference(checkpoint, SETUP, prompts, SamplingParams(max_tokens=cf.MAX_TOKENS, ignore_eos=True))
    rows = cf.run_faults(cluster, faults, prompts, want)
    (prefill,) = cluster.cluster.pools["prefill"].workers
    (decode,) = cluster.cluster.pools["decode"].workers
    for row in rows:
        assert row.tokens_equal, row
        assert row.held_after == 0, row
        if row.fault is None:
            assert (row.caught_by, row.detail) == ("", ""), row
            continue
        assert row.caught_by == EXPECTED[row.fault.side], row
        assert row.detail.startswith(f"the KV from {prefill.worker_id} to {decode.worker_id} failed: "), row
        assert row.detect_ms is not None and row.detect_ms >= 0, row
    meaning = {r.fault: r.detail for r in rows if r.caught_by == "meaning"}
    assert all("layer" in d and "position" in d for d in meaning.values()), meaning
    assert meaning[F.LAYERS_SWAPPED].count("MeaningMismatch") == 1
