"""meta.json beside a capture (actors/trace/meta_file.py): the workload fields the OOM study
rebuilds the model from are checked, naming the file and the field (host-gap calibration's
fields are tested in test_host_gaps.py)."""
from __future__ import annotations

import pytest

from actors.errors import TraceError
from orchestrator import study_traces


@pytest.mark.parametrize("text, field", [
    ('{"world_size": 2}', "field 'workload' is missing"),
    ('{"workload": [], "world_size": 2}', "field 'workload' is []"),
    ('{"workload": {}, "world_size": "2"}', 'field \'world_size\' is "2"'),
    ('{"workload": {}, "world_size": 0}', "field 'world_size' is 0"),
    ('{"workload": {}, "world_size": true}', "field 'world_size' is true"),
])
def test_a_malformed_workload_names_the_file_and_field(tmp_path, text, field):
    (tmp_path / "meta.json").write_text(text)
    with pytest.raises(TraceError) as err:
        study_traces.traced_model(tmp_path)
    assert err.value.path == str(tmp_path / "meta.json") and field in str(err.value)
