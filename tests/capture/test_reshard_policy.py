"""FSDP2's reshard-after-forward policy (workload.reshard_after_forward), torchtitan's three:
which blocks free their gathered parameters after forward, with and without a pipeline."""
from __future__ import annotations

import pytest

from actors.capture.workloads.fsdp2 import reshards_after_forward
from actors.capture.workloads.config import WorkloadConfig
from actors.errors import ConfigError


@pytest.mark.parametrize("policy, pipelined, expected", [
    ("default", False, [True, True, True, False]),  # the last block's backward comes at once
    ("default", True, [False] * 4),  # every micro-batch's forward would gather again
    ("always", False, [True] * 4),
    ("always", True, [True] * 4),
    ("never", False, [False] * 4),
    ("never", True, [False] * 4),
])
def test_policy_picks_the_blocks_that_reshard(policy, pipelined, expected):
    cfg = WorkloadConfig(model="llama", reshard_after_forward=policy)
    assert [reshards_after_forward(cfg, i, 4, pipelined) for i in range(4)] == expected


def test_a_policy_typo_is_refused():
    with pytest.raises(ConfigError, match="reshard_after_forward='sometimes'; expected one of "
                                          "default, always, never"):
        WorkloadConfig(reshard_after_forward="sometimes")
