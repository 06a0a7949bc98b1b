"""A stand-in for DistributedDataParallel's C++ reducer on ``workload.device=fake``.

DDP's Python (``torch/nn/parallel/distributed.py``) runs unchanged; only the reducer it builds
(``dist.Reducer``) is this class, installed by :mod:`actors.capture.fake.fake_ddp`. It holds, frees
and communicates what the real reducer does (``torch/csrc/distributed/c10d/reducer.cpp``), with
the same ops, so the ET observer records the same trace:

* buckets: one flat ``gradients`` tensor per bucket, allocated at construction from DDP's
  assignment (first iteration: one bucket per dtype unless ``find_unused_parameters``) and
  held for the model's lifetime; every parameter has a view into it (``as_strided`` to its
  layout). After the first iteration that reduced, the next forward rebuilds them in the
  order the gradients became ready, with ``dist._compute_bucket_assignment_by_size`` (the
  reducer's own function: the first bucket ``first_bucket_bytes_cap``, then
  ``bucket_cap_mb``), broadcasting the assignment as the reducer does;
* per gradient, when its accumulator has run (a post hook on the ``AccumulateGrad`` node, as
  the reducer registers): ``mul(grad, 1 / world, out=view)`` (the divide by world size),
  ``grad`` then *becoming* the view with ``gradient_as_bucket_view``; a bucket whose
  gradients are all in is all-reduced at once (``c10d::allreduce_``, async, buckets in order);
* at the end of backward (an engine callback): wait, views of the result, then each gradient
  copied back (``copy_bucket_to_grad``) or left as the bucket's view;
* ``no_sync`` (DDP skips ``prepare_for_backward``: the hooks return, gradients accumulate),
  ``find_unused_parameters`` (graph search, unused parameters' views zeroed, the int32 used
  map all-reduced) and ``static_graph`` (first iteration reduced in one go at the end).

Fake tensors carry no values, so where the reducer reads one (the used map's entries) the
stand-in keeps the answer itself: on fake every rank runs rank 0's program. Errors the real
reducer raises for the user's program (a gradient missing or arriving twice) are RuntimeErrors
here too; what it does not model is a ConfigError (:func:`refused`).
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.profiler import record_function

from actors.capture.fake.fake_buckets import Bucket, broadcast_assignment, is_alias
from actors.errors import ConfigError

FAKE = "workload.device=fake"
# The stand-ins of the capture running now (fake_ddp.ddp_on_fake empties it on entry and exit).
LIVE: "weakref.WeakSet[FakeReducer]" = weakref.WeakSet()


def rebuild_pending() -> bool:
    """Whether a live stand-in still has its one bucket rebuild ahead (more warm-up needed
    before the recorded iteration is the steady state a real capture records)."""
    return any(r.should_rebuild_buckets() for r in LIVE)


def refused(what: str) -> ConfigError:
    """The error for a DDP feature the stand-in does not model."""
    return ConfigError(f"DistributedDataParallel on {FAKE}: {what} is not modelled by the "
                       "fake reducer; capture this step on cpu or cuda")


class FakeReducer:
    """``dist.Reducer``'s constructor and the methods DDP's Python calls (see the module
    docstring); any other reducer method raises ConfigError naming it."""

    def __init__(self, params, bucket_indices, per_bucket_size_limits, process_group,
                 expect_sparse_gradient=(), bucket_bytes_cap=25 * 1024 * 1024,
                 find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=dist._DEFAULT_FIRST_BUCKET_BYTES,
                 skip_all_reduce_unused_params=False, use_python_reducer=False,
                 bucket_bytes_cap_list=(), batched_grad_copy=False):
        unmodelled = {"sparse gradients (sparse=True embeddings)": any(expect_sparse_gradient),
                      "bucket_cap_mb_list": bool(bucket_bytes_cap_list),
                      "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
                      "batched_grad_copy": batched_grad_copy,
                      "the compiled (python) reducer": use_python_reducer}
        for what, used in unmodelled.items():
            if used:
                raise refused(what)
        self._params = list(params)
        self._group = process_group
        self._sparse = [False] * len(self._params)
        self._bucket_bytes_cap = bucket_bytes_cap
        self._first_bucket_bytes_cap = first_bucket_bytes_cap
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._static = False
        self._expect_hooks = self._require_finalize = False
        self._has_marked_unused = self._has_rebuilt = self._first_hook_called = False
        self._num_iterations = self._num_bwd_calls = self._next_bucket = 0
        self._unused: list[int] = []
        self._ready: set[int] = set()
        self._rebuilt: list[int] = []  # parameter indices in the order their gradients came
        self._hooks_fired = [0] * len(self._params)  # static graph: hooks per parameter
        self._hooks_left: list[int] = []
        self._used_map = self._used_map_dev = self._used_work = None
        self._used: set[int] = set()  # the used map's 1s (fake tensors hold no values)
        self._used_reduced = False
        self._buckets: list[Bucket] = []
        self._locator: list[tuple[int, int]] = []
        self._initialize_buckets([list(b) for b in bucket_indices])
        # The reducer's hook runs after each parameter's AccumulateGrad node (a post hook).
        self._accumulators = [torch.autograd.graph.get_gradient_edge(p).node
                              for p in self._params]
        self._handles = [acc.register_hook(self._hook_for(i))
                         for i, acc in enumerate(self._accumulators)]
        if self._find_unused:
            self._initialize_used_map()
        LIVE.add(self)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise refused(f"the reducer's {name}() (used by DDP's join(), comm hooks, "
                      "mixed_precision or optimizer-in-backward)")

    # --- construction and rebuild -------------------------------------------------------
    def _initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        self._buckets = []  # the old buckets' memory goes first, as in the reducer
        self._locator = [(0, 0)] * len(self._params)
        for b, indices in enumerate(bucket_indices):
            bucket = Bucket(self._params, indices)
            for j, i in enumerate(indices):
                self._locator[i] = (b, j)
                grad = self._params[i].grad
                if self._as_view and grad is not None and not is_alias(grad, bucket.views_in[j]):
                    bucket.views_in[j].copy_(grad)
                    self._params[i].grad = bucket.views_in[j]
            self._buckets.append(bucket)

    def _initialize_used_map(self) -> None:
        self._used_map = torch.zeros(len(self._params), dtype=torch.int32)
        self._used_map_dev = torch.empty(len(self._params), dtype=torch.int32,
                                         device=self._params[0].device)

    def should_rebuild_buckets(self) -> bool:
        """The reducer's rule: once, and only where the graph is known to reach every bucket."""
        return (self._static or not self._find_unused) and not self._has_rebuilt

    def _rebuild_buckets(self) -> bool:
        self._ensure_prior_reduction_finished()
        if not self.should_rebuild_buckets() or not self._rebuilt:
            return False
        if sorted(self._rebuilt) != list(range(len(self._params))):
            raise RuntimeError("DDP bucket rebuild: gradients came for "
                               f"{len(set(self._rebuilt))} of {len(self._params)} parameters "
                               "(the reducer asserts every parameter's, once)")
        limits = [self._first_bucket_bytes_cap, self._bucket_bytes_cap]
        order = list(self._rebuilt)
        last_small = os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1"
        if last_small:  # the smaller bucket goes last instead of first
            order.reverse()
        indices, _ = dist._compute_bucket_assignment_by_size(
            [self._params[i] for i in order], limits, self._sparse, order)
        if last_small:
            indices.reverse()
        broadcast_assignment(indices, self._params[0].device, self._group)
        self._has_rebuilt = True
        self._rebuilt = []
        self._initialize_buckets(indices)
        return True

    # --- what DDP's forward calls ---------------------------------------------------------
    def prepare_for_forward(self) -> None:
        self._num_iterations += 1

    def prepare_for_backward(self, outputs) -> None:
        self._expect_hooks = True
        self._next_bucket = 0
        for bucket in self._buckets:
            bucket.pending = len(bucket.indices)
        if self._static:
            self._hooks_left = list(self._hooks_fired)
        self._has_marked_unused = False
        self._ready.clear()
        if self._dynamic_find_unused():
            self._unused = self._search_unused(outputs)

    def _search_unused(self, outputs) -> list[int]:
        with record_function("torch.distributed.ddp.reducer::search_unused_parameters"):
            seen, queue = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
            while queue:
                for fn, _ in queue.pop().next_functions:
                    if fn is not None and fn not in seen:
                        seen.add(fn)
                        queue.append(fn)
        return [i for i, acc in enumerate(self._accumulators) if acc not in seen]

    def set_logger(self, logger) -> None:
        pass  # the fake logger logs nothing (actors/capture/fake/fake_ddp.py)

    def _set_static_graph(self) -> None:
        if self._num_iterations:
            raise RuntimeError("DDP static_graph must be set before the first iteration")
        self._static = True
        self._initialize_used_map()

    def _check_reducer_finalized(self) -> None:
        self._ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _ensure_prior_reduction_finished(self) -> None:
        if self._require_finalize:
            missing = [i for i in range(len(self._params)) if i not in self._ready]
            raise RuntimeError("Expected to have finished reduction in the prior iteration "
                               "before starting a new one (DDP): parameter indices that did "
                               f"not receive grad: {missing}")

    # --- backward ------------------------------------------------------------------------
    def _dynamic_find_unused(self) -> bool:
        return self._find_unused and not self._static

    def _static_first(self) -> bool:
        return self._static and self._num_bwd_calls == 1

    def _hook_for(self, index: int):
        def hook(grad_inputs, grad_outputs):
            self._autograd_hook(index)
        return hook

    def _autograd_hook(self, index: int) -> None:
        if not self._first_hook_called:
            self._first_hook_called = True
            self._num_bwd_calls += 1
        if (self._dynamic_find_unused() or self._static_first()) \
                and self._params[index].grad is not None:
            self._used_map.select(0, index).fill_(1)  # the reducer's ``map[index] = 1``
            self._used.add(index)
        if self._static_first():
            self._hooks_fired[index] += 1
            return
        if not self._expect_hooks:  # no_sync: the gradient just accumulates
            return
        if not self._has_marked_unused:
            self._has_marked_unused = True
            for unused in self._unused:
                self._mark_variable_ready(unused)
        if self._static and self._num_bwd_calls > 1:
            if self._hooks_left[index] <= 0:
                raise RuntimeError("DDP static_graph: the training graph changed after the "
                                   "first iteration (a parameter's gradient came again)")
            self._hooks_left[index] -= 1
            if self._hooks_left[index]:
                return
        if self.should_rebuild_buckets():
            self._rebuilt.append(index)
        self._mark_variable_ready(index)

    def _mark_variable_ready(self, index: int) -> None:
        if index in self._ready:
            raise RuntimeError(f"DDP: parameter {index} marked ready twice in one iteration "
                               "(reentrant backward or a parameter used outside forward)")
        self._ready.add(index)
        self._require_finalize = True
        b, _ = self._locator[index]
        self._copy_grad_in(index)
        self._buckets[b].pending -= 1
        if self._buckets[b].pending == 0:
            self._mark_bucket_ready(b)
        if self._next_bucket == len(self._buckets):
            if self._dynamic_find_unused():
                self._all_reduce_used_map()
            Variable._execution_engine.queue_callback(self._finalize_callback)

    def _copy_grad_in(self, index: int) -> None:
        """The gradient into its bucket view, divided by the world size on the way."""
        b, j = self._locator[index]
        view, param = self._buckets[b].views_in[j], self._params[index]
        grad = param.grad
        factor = 1.0 / self._group.size()
        if grad is None:
            view.zero_()
        elif is_alias(grad, view):
            view.div_(self._group.size())
        else:
            if grad.requires_grad:  # create_graph=True: divided out of place, then copied
                scaled = torch.mul(grad, factor)
                with record_function("torch::distributed::reducer::copy_"):
                    view.copy_(scaled)
            else:
                with record_function("torch::distributed::reducer::mul_out"):
                    torch.mul(grad, factor, out=view)
            if self._as_view:
                param.grad = view

    def _mark_bucket_ready(self, b: int) -> None:
        if b > self._next_bucket:  # buckets are reduced in order
            return
        while self._next_bucket < len(self._buckets) \
                and self._buckets[self._next_bucket].pending == 0:
            self._all_reduce(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _all_reduce(self, bucket: Bucket) -> None:
        bucket.work = dist.all_reduce(bucket.gradients, group=self._group, async_op=True)

    def _all_reduce_used_map(self) -> None:
        self._used_map_dev.copy_(self._used_map, non_blocking=True)
        self._used_work = dist.all_reduce(self._used_map_dev, group=self._group, async_op=True)

    def _delay_all_reduce(self) -> None:
        """static_graph's first iteration: everything reduced once backward is over."""
        self._all_reduce_used_map()
        self._unused = [i for i, n in enumerate(self._hooks_fired) if n == 0]
        self._require_finalize = True
        for index in range(len(self._params)):
            self._copy_grad_in(index)
        for bucket in self._buckets:
            self._all_reduce(bucket)
        self._finalize_backward()

    def _finalize_callback(self) -> None:
        if self._static and self._num_bwd_calls > 1 and self.should_rebuild_buckets():
            self._rebuilt += self._unused
        self._finalize_backward()

    def _finalize_backward(self) -> None:
        self._expect_hooks = self._first_hook_called = self._require_finalize = False
        for bucket in self._buckets:
            bucket.work.wait()
            # The all-reduce's result is the bucket itself: views of it, per parameter.
            bucket.views_out = bucket.views_of(bucket.gradients, self._params)
            for j, index in enumerate(bucket.indices):
                self._copy_grad_out(bucket, j, index)
        if (self._dynamic_find_unused() or self._static_first()) and not self._used_reduced:
            self._used_work.wait()
        if self._dynamic_find_unused():
            self._used_map.fill_(0)
            self._used.clear()
            self._used_reduced = False

    def _copy_grad_out(self, bucket: Bucket, j: int, index: int) -> None:
        param = self._params[index]
        unused = False
        if self._static or self._find_unused:
            unused = index not in self._used
            if unused and not self._used_reduced:  # the reduced map is read back once
                self._used_work.wait()
                self._used_map.copy_(self._used_map_dev)
                self._used_reduced = True
        if not self._as_view:
            with record_function("torch.distributed.ddp.reducer::copy_bucket_to_grad"):
                if unused:
                    return
                if param.grad is None:  # the layout AccumulateGrad would give it
                    grad = torch.empty_strided(param.size(), param.stride(), dtype=param.dtype,
                                               device=param.device)
                    param.grad = grad.copy_(bucket.views_out[j])
                else:
                    param.grad.copy_(bucket.views_out[j])
            return
        view_in, view_out = bucket.views_in[j], bucket.views_out[j]
        if not is_alias(view_in, view_out):
            view_in.copy_(view_out)
        if not unused and param.grad is None:
            param.grad = view_in
