"""The trace model: load an Execution Trace into typed, compact records (pure data, no torch)."""
from actors.trace.liveness import Liveness, compute_liveness
from actors.trace.loader import load_trace, rank_from_name
from actors.trace.node_stream import read_json
from actors.trace.model import Arg, Collective, Op, ProcessGroupInfo, Step, TensorArg, Trace

__all__ = ["Arg", "Collective", "Liveness", "Op", "ProcessGroupInfo", "Step", "TensorArg", "Trace",
           "compute_liveness", "load_trace", "rank_from_name", "read_json"]
