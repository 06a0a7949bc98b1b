"""The built-in model families, one folder each (torchtitan's ModelSpec layout): a family's
model code and its :class:`~actors.capture.workloads.models.spec.ModelSpec` (how to build it, its
blocks, its feed-forward rule, its own checks, which recipes it supports), registered by name in
:mod:`actors.capture.workloads.models.registry`; ``workload.model`` picks one."""
