"""The environment variables a user's step reads are part of what its capture was made with
(actors/capture/environment_reads.py): meta.json keeps them, and the capture cache reuses a
capture only where their values are unchanged (orchestrator/studies/study_traces.py)."""
from __future__ import annotations

import json
import os
import sysconfig
import textwrap

import pytest

from actors.capture.environment_reads import environment_reads
from actors.errors import TraceError
from actors.trace.meta_file import environment_changes

STEP = textwrap.dedent('''
    import os
    import torch
    import torch.nn as nn

    WIDTH = int(os.environ.get("TF_ENV_TEST_WIDTH", "8"))  # read at import

    def build(ctx):
        net = nn.Linear(WIDTH, WIDTH).to(ctx.device)
        depth = int(os.getenv("TF_ENV_TEST_DEPTH") or 1)  # read in build, unset by default
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(batch):
            for _ in range(depth):
                net(batch[0]).sum().backward()
            opt.step()
            opt.zero_grad()

        return net, lambda: (torch.randn(4, WIDTH, device=ctx.device),), step
''')


def test_only_the_users_reads_are_recorded(tmp_path, monkeypatch):
    (tmp_path / "reader.py").write_text(
        "import os\n"
        "def read():\n"
        "    return (os.environ.get('TF_A'), os.getenv('TF_B'), 'TF_C' in os.environ,\n"
        "            os.environ['HOME'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import reader
    import torch

    # an installed package's read (torch, sympy read plenty at import): code whose file is in
    # site-packages, which a virtual environment keeps inside its own standard library folder
    package_code = compile("import os\nos.environ.get('TF_PACKAGES_OWN')",
                           os.path.join(sysconfig.get_paths()["purelib"], "somepkg", "x.py"),
                           "exec")
    with environment_reads() as names:
        exec(package_code, {})  # noqa: S102 (a test's own code, not a trace's)
    assert names == set()

    with environment_reads() as names:
        reader.read()
        torch.get_num_threads()
        os.environ.get("TF_NOT_THE_USERS")  # this test file is the user's too: recorded
        json.dumps({})  # the standard library's own reads are not
    assert names == {"TF_A", "TF_B", "TF_C", "HOME", "TF_NOT_THE_USERS"}
    with environment_reads() as names:
        pass
    assert names == set()


def test_a_capture_made_with_other_values_is_not_reused(tmp_path, monkeypatch):
    from actors.capture.workloads.config import WorkloadConfig
    from orchestrator.studies.study_traces import capture_cached

    step = tmp_path / "my_step.py"
    step.write_text(STEP)
    wl = WorkloadConfig(model="custom", entrypoint=f"{step}:build", device="fake",
                        parallel="local")
    cache = str(tmp_path / "cache")
    monkeypatch.delenv("TF_ENV_TEST_DEPTH", raising=False)
    monkeypatch.setenv("TF_ENV_TEST_WIDTH", "8")
    first, reused = capture_cached(wl, 1, cache, "custom")
    meta = json.loads((first.folder / "meta.json").read_text())
    assert first.meta == meta  # what the capture wrote, returned
    assert not reused and meta["environment"] == {"TF_ENV_TEST_DEPTH": None,
                                                  "TF_ENV_TEST_WIDTH": "8"}
    monkeypatch.setenv("TF_ENV_TEST_WIDTH", "16")  # the same settings, another model
    second, reused = capture_cached(wl, 1, cache, "custom")
    assert not reused and second.folder != first.folder
    meta2 = json.loads((second.folder / "meta.json").read_text())
    assert meta2["environment"]["TF_ENV_TEST_WIDTH"] == "16"
    # the file was loaded again in this process: its import-time read saw the new value
    assert (meta["num_params"], meta2["num_params"]) == (8 * 8 + 8, 16 * 16 + 16)
    monkeypatch.setenv("TF_ENV_TEST_WIDTH", "8")  # back: the first capture serves again
    assert capture_cached(wl, 1, cache, "custom") == (first, True)
    monkeypatch.setenv("TF_ENV_TEST_WIDTH", "16")
    assert capture_cached(wl, 1, cache, "custom") == (second, True)


@pytest.mark.parametrize("environment", [["A"], {"A": 1}, {"A": ["x"]}])
def test_a_malformed_environment_field_names_the_file(tmp_path, environment):
    with pytest.raises(TraceError, match=r"meta\.json: field 'environment' is .*expected an "
                                         r"object of variable names"):
        environment_changes(tmp_path / "meta.json", {"environment": environment})


def test_environment_changes_name_each_variable_with_both_values(monkeypatch):
    monkeypatch.setenv("TF_X", "2")
    monkeypatch.delenv("TF_Y", raising=False)
    assert environment_changes("m.json", {"environment": {"TF_X": "1", "TF_Y": None}}) == [
        "TF_X (was '1', now '2')"]
    assert environment_changes("m.json", {}) == []
