"""actors/capture/request.py: the typed request every capture rank runs crosses a process
boundary (a worker process, a Ray actor: both pickle it) and comes back equal; plain values
(a meta.json's, a test's JSON) become one through ``from_dict``, unknown keys refused."""
from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from actors.capture.request import CaptureRequest
from actors.capture.workloads.config import WorkloadConfig
from actors.capture.workloads.mesh import ParallelismConfig
from actors.errors import ConfigError
from orchestrator.run.capture import CaptureConfig

WORKLOAD = WorkloadConfig(model="llama", parallel="fsdp2", device="fake", d_model=64, n_heads=4,
                          parallelism=ParallelismConfig(tp=2), gpu_kernels="sm90")


def _echo(request: CaptureRequest) -> CaptureRequest:
    return request


def test_the_request_of_a_config_crosses_a_process_and_comes_back_equal():
    cfg = CaptureConfig(workload=WORKLOAD, world_size=4, warmup_iters=2, timing_iters=7,
                        num_threads=3, dist_timeout_s=12.5, module_backward_ranges=False,
                        record_kineto=False)
    request = cfg.request()
    assert request == CaptureRequest(WORKLOAD, 2, 7, 3, 12.5, False, False)
    assert request.workload is not cfg.workload  # a rank shares nothing with the driver's
    assert pickle.loads(pickle.dumps(request)) == request
    spawn = multiprocessing.get_context("spawn")  # as the role workers start
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        back = pool.submit(_echo, request).result(timeout=300)
    assert back == request and type(back.workload.parallelism) is ParallelismConfig
    assert back.workload.gpu_kernels == "sm90" and back.workload.parallelism.tp == 2


def test_plain_values_become_a_request_and_unknown_keys_are_named():
    request = CaptureConfig(workload=WORKLOAD).request()
    assert CaptureRequest.from_dict(dataclasses.asdict(request)) == request
    assert CaptureRequest.from_dict({"workload": {"d_model": 8}}).workload.d_model == 8
    with pytest.raises(ConfigError, match="unknown workload key.* d_modle"):
        CaptureRequest.from_dict({"workload": {"d_modle": 3}})
    with pytest.raises(ConfigError, match="unknown capture key.* warmup"):
        CaptureRequest.from_dict({"workload": {}, "warmup": 1})
