"""The naming conventions of captured traces (actors/capture/ writes them; actors/trace,
actors/zero3 and the driver read them). No torch import, so trace readers parse them cheaply:

* file per rank: ``rank-<r>.et.json.gz`` (:func:`trace_file_name`), and beside it the
  profiler (Kineto) trace of the same iteration, ``rank-<r>.kineto.json.gz``
  (:func:`kineto_file_name`; read by :mod:`actors.trace.kineto`);
* the recorded iteration is wrapped in a ``ProfilerStep#<n>`` range (:data:`STEP_PREFIX`);
* every module call is wrapped in a range named ``## module:<qualified name> ##`` (its
  node is the ``ctrl_deps`` ancestor of the module's forward operators), where the
  qualified name is the one ``model.named_modules()`` gives (``blocks.0.attn``); the root
  module is ``<root>`` (:data:`ROOT_MODULE_NAME`);
* backward is delimited by zero-length marker nodes, ``## module_bwd_begin:<qualname> ##``
  when the gradient of the module's output is ready and ``## module_bwd_end:<qualname> ##``
  when the gradients of its inputs are computed: the module's backward operators are the
  ones between the two markers in execution (node id) order. Markers, not ranges, because
  backward hooks open and close across the autograd engine's own ranges, which would
  corrupt the observer's parent stack. A module none of whose inputs require grad (an
  embedding) gets both markers at once, when its output gradient is ready.

* a fake capture writes the run's own frees: a ``tracefleet::freed`` op (:data:`FREED_OP`)
  whose one input lists zero-size views of the storages freed since the previous op ran
  (or, at the end of the step, since the last one); storages the user's code held past their
  last use die there, not at their last use (actors/capture/fake/free_markers.py,
  actors/trace/recorded_frees.py).

* a fake capture names the storage id of tensor-subclass wrappers: a ``tracefleet::wrapper_storage``
  op (:data:`WRAPPER_STORAGE_OP`) whose one input is a zero-size tensor on the null data
  pointer, the id the observer gives every wrapper (a DTensor); an op on it that reached no
  subclass frame (torchao's ``p.detach()`` of a DTensor parameter) did no work
  (actors/trace/subclass_wrappers.py).

* a fake capture for a GPU target names the host copies a step's
  ``torch.autograd.graph.save_on_cpu`` made: a ``tracefleet::host_storage`` op
  (:data:`HOST_STORAGE_OP`) whose one input lists them; the loader collects their storage
  generations (``Trace.host_storages``), which a prediction counts as host memory, not the
  device's (actors/capture/fake/host_copies.py).

A parameter ``blocks.0.attn.qkv.weight`` belongs to the innermost module whose qualified
name is a prefix of it.
"""
from __future__ import annotations

STEP_PREFIX = "ProfilerStep#"
MODULE_PREFIX = "## module:"
MODULE_BWD_BEGIN_PREFIX = "## module_bwd_begin:"
MODULE_BWD_END_PREFIX = "## module_bwd_end:"
MODULE_SUFFIX = " ##"
ROOT_MODULE_NAME = "<root>"
FREED_OP = "tracefleet::freed"
WRAPPER_STORAGE_OP = "tracefleet::wrapper_storage"
HOST_STORAGE_OP = "tracefleet::host_storage"

FORWARD, BWD_BEGIN, BWD_END = "forward", "bwd_begin", "bwd_end"
_PREFIXES = ((MODULE_PREFIX, FORWARD), (MODULE_BWD_BEGIN_PREFIX, BWD_BEGIN),
             (MODULE_BWD_END_PREFIX, BWD_END))


def trace_file_name(rank: int) -> str:
    """The file name of one rank's captured trace."""
    return f"rank-{rank}.et.json.gz"


def kineto_file_name(rank: int) -> str:
    """The file name of one rank's profiler (Kineto) trace of the recorded iteration."""
    return f"rank-{rank}.kineto.json.gz"


def module_range_name(qualname: str, kind: str = FORWARD) -> str:
    """The record_function name of a module's forward range or backward marker."""
    prefix = next(p for p, k in _PREFIXES if k == kind)
    return f"{prefix}{qualname or ROOT_MODULE_NAME}{MODULE_SUFFIX}"


def parse_module_range(name: str) -> tuple[str, str] | None:
    """``(qualified name, kind)`` of a module range or marker name, None for any other name.

    kind is :data:`FORWARD`, :data:`BWD_BEGIN` or :data:`BWD_END`; the root module comes
    back as ``""``.
    """
    if not name.endswith(MODULE_SUFFIX):
        return None
    for prefix, kind in _PREFIXES:
        if name.startswith(prefix):
            qualname = name[len(prefix):-len(MODULE_SUFFIX)]
            return ("" if qualname == ROOT_MODULE_NAME else qualname), kind
    return None
