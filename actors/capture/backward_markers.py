"""Where each module's backward begins and ends, found from the autograd graph without touching
the tensors.

torch's full backward hooks (``register_full_backward_pre_hook`` / ``_hook``) wrap a module's
inputs and outputs in an identity autograd Function (``BackwardHookFunction``), which costs
the trace and breaks common models:

* the wrapper's outputs are views of its inputs, so an in-place op on a module's output or
  input (``nn.ReLU(inplace=True)`` after a BatchNorm, ResNet's ``out += identity``: torchvision's
  ResNet, MobileNet, EfficientNet, DenseNet) fails the forward ("Output 0 of
  BackwardHookFunction is a view and is being modified inplace");
* only a Tensor or a tuple output is wrapped: a module returning a Hugging Face
  ``ModelOutput`` (every HF base model), a dict or a list warns and gets no markers;
* the wrapper's views and the gradient accumulations it moves are ops of their own in the
  trace, which the uninstrumented step does not run.

:func:`register_backward_markers` uses hooks only, on the graph one module call builds. A
forward pre hook notes autograd's sequence number; the forward hook (also when the forward
raised) takes the nodes the call created (sequence numbers since then) reachable from its
outputs' ``grad_fn`` (the outputs found with ``torch.utils._pytree``, where transformers
registers ``ModelOutput``), and the *sinks* among them: nodes that hand every gradient out of
the call (to its inputs, its parameters' accumulators, earlier ops).

* ``begin``: once the backward reaches one of the call's outputs (a multi-grad hook: just
  before the node that made it runs), before any op of the call's backward. torch's wrapper
  holds every output's gradient back until all are there and fires its pre hook then; without
  a wrapper, the backward of one output (a ``ModelOutput``'s auxiliary loss) can start before
  another's gradient exists;
* ``end``: once every sink the backward runs has run (node hooks): the call's own backward
  is over, its parameters' gradients computed. torch's full backward hook fires when the
  gradients w.r.t. the inputs are, the same moment for a module whose inputs need grad, and at
  ``begin`` when none does (an embedding): here the end still follows its backward op.

A call whose outputs need no grad, or hold no tensor made in it (a parameter or an input
returned as is), gets no markers: it has no backward of its own.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

_sequence_nr = torch._C._autograd._get_sequence_nr  # the next autograd node's number (thread)


def _call_nodes(outputs: list[torch.Tensor], first: int, end: int) -> list:
    """The autograd nodes numbered first..end-1 (made by the call) reachable from outputs."""
    seen, stack, nodes = set(), [t.grad_fn for t in outputs], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or not first <= node._sequence_nr() < end:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return nodes


class _Call:
    """One module call's markers: begin on its first output gradient, end after its sinks."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None], sinks: list):
        self.begin, self.end, self.sinks = begin, end, sinks
        self.pending: set[int] | None = None  # sinks still to run, once begun
        self.ran: set[int] = set()  # sinks run before the begin (gradients from elsewhere)

    def on_output(self, _grad) -> None:
        self.begin()
        self.pending = {id(s) for s in self.sinks
                        if torch._C._will_engine_execute_node(s)} - self.ran
        if not self.pending:
            self.end()

    def on_sink(self, sink) -> None:
        if self.pending is None:
            self.ran.add(id(sink))
        elif id(sink) in self.pending:
            self.pending.discard(id(sink))
            if not self.pending:
                self.end()


def register_backward_markers(module: torch.nn.Module, begin: Callable[[], None],
                              end: Callable[[], None]) -> list:
    """Call ``begin`` and ``end`` where each call of ``module`` has its backward begin and end
    (module docstring); returns the hook handles."""
    firsts: list[int] = []  # sequence numbers at the entry of the calls under way (recursion)

    def pre_hook(_module, _args):
        firsts.append(_sequence_nr())

    def post_hook(_module, _args, output):
        first = firsts.pop()
        if output is None or not torch.is_grad_enabled():
            return
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)
                   and t.requires_grad and t.grad_fn is not None]
        nodes = _call_nodes(outputs, first, _sequence_nr())
        if not nodes:
            return
        inside = set(nodes)
        sinks = [n for n in nodes if not any(nxt in inside for nxt, _ in n.next_functions)]
        call = _Call(begin, end, sinks)
        for sink in sinks:
            sink.register_hook(lambda _gi, _go, s=sink: call.on_sink(s))
        register_multi_grad_hook([t for t in outputs if t.grad_fn in inside],
                                 call.on_output, mode="any")

    return [module.register_forward_pre_hook(pre_hook),
            module.register_forward_hook(post_hook, always_call=True)]
