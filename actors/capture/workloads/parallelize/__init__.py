"""Recipes that split the built-in Llama decoder over an N-D device mesh, as torchtitan's
``parallelize`` applies them: tensor parallel with sequence parallel and loss parallel
(:mod:`.tensor_parallel`), context parallel's ring attention (:mod:`.context_parallel`), and
FSDP2 or HSDP over the data-parallel dimensions (:mod:`.recipe`). The mesh itself is
actors/capture/workloads/mesh.py."""
