"""The built-in workloads and recipes: what a capture trains. The config
(:mod:`~actors.capture.workloads.config`), the builder (:mod:`~actors.capture.workloads.build`),
the model families (``models/``, one folder each), the parallelisms (``parallelize/``, the
data-parallel wrappers, FSDP2, ZeRO-3), the blocks they share (attention, MoE, SwiGLU,
checkpointing), a user's own step (``custom``) and what every builder is given and returns
(``context``)."""
