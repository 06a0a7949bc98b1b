"""The campaign over what tracefleet takes from elsewhere (scripts/fuzz_inputs.py): snapshots,
prediction and run dirs, meta.json, command-line values and the Python API's arguments. No case
may end in a traceback, and no value that can never be right may be accepted."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fuzz_inputs  # noqa: E402

# every k-th case of a family (the whole campaign is the script's: 900+ cases)
EVERY = {"snapshot": 9, "prediction": 1, "run_dir": 3, "meta": 1, "config": 1, "api": 1}


@pytest.mark.parametrize("family", list(fuzz_inputs.FAMILIES))
def test_no_traceback_and_no_wrong_answer(family, tmp_path):
    outcomes: dict[str, list[str]] = {}
    for k, (name, files, must_refuse) in enumerate(fuzz_inputs.FAMILIES[family]()):
        if k % EVERY[family]:
            continue
        folder = tmp_path / str(k)
        folder.mkdir()
        result = fuzz_inputs.run_case(name, files, must_refuse, folder)
        outcomes.setdefault(result["outcome"], []).append(f"{name}: {result['message']}")
    bad = {k: v for k, v in outcomes.items() if k in fuzz_inputs.BAD}
    assert not bad, bad
    assert outcomes.get("clear"), outcomes  # the family does reach its checks
