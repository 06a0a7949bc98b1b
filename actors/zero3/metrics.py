"""Per-rank ZeRO-3 figures: counted and timed per iteration, summarized over measured ones.

Host times are the replay's own bookkeeping around each all-gather (allocating the gathered
buffer, filling this rank's slot, issuing the collective; after the wait, copying parameters
out or making views and binding them), ``release_host_s`` its unbinding and freeing; neither
includes ``wait_s``, the time blocked on the collective. ``bubble_s`` is the whole time the
op stream stood still in ZeRO-3 hooks (fetch, wait and release together): what the compute
waited for parameters. Bytes are measured from the tensors allocated.
"""
from __future__ import annotations

import statistics

_PER_ITERATION = ("num_allgathers", "num_allgathers_intra_group", "allgather_bytes",
                  "fetch_host_s", "release_host_s", "wait_s", "bubble_s", "num_reduce_scatters",
                  "reduce_scatter_bytes", "reduce_scatter_s")


class Zero3Metrics:
    """Counters of the current iteration, the kept measured iterations and memory peaks."""

    def __init__(self):
        self.shard_bytes = 0  # this rank's shards of partitioned parameters
        self.persistent_bytes = 0  # parameters kept whole (param_persistence_threshold)
        self.gathered_bytes = 0  # gathered buffers and parameters held right now
        self.gathered_peak_bytes = 0
        self.scratch_bytes = 0  # update phase: shard-sized parameter scratch and temporaries
        self.scratch_peak_bytes = 0
        self.optimizer_state_bytes = 0  # shards of optimizer state (exp_avg, ...), kept
        self.grad_shard_bytes = 0  # shards of gradients held right now (reduce-scatter outputs)
        self.grad_shard_peak_bytes = 0
        self.grad_full_bytes = 0  # full gradients held right now (made, not yet reduced)
        self.grad_full_peak_bytes = 0
        self.secondary_bytes = 0  # hpZ: node-local shards kept from forward to backward
        self.secondary_peak_bytes = 0
        self.iterations: list[dict] = []
        self.start_iteration()

    def start_iteration(self) -> None:
        self.num_allgathers = self.num_allgathers_intra_group = self.allgather_bytes = 0
        self.fetch_host_s = self.release_host_s = self.wait_s = self.bubble_s = 0.0
        self.num_reduce_scatters = self.reduce_scatter_bytes = 0
        self.reduce_scatter_s = 0.0

    def end_iteration(self, measured: bool) -> None:
        if measured:
            self.iterations.append({k: getattr(self, k) for k in _PER_ITERATION})

    def add_gathered(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)

    def add_secondary(self, nbytes: int) -> None:
        self.secondary_bytes += nbytes
        self.secondary_peak_bytes = max(self.secondary_peak_bytes, self.secondary_bytes)

    def add_scratch(self, nbytes: int) -> None:
        self.scratch_bytes += nbytes
        self.scratch_peak_bytes = max(self.scratch_peak_bytes, self.scratch_bytes)

    def add_grad_full(self, nbytes: int) -> None:
        self.grad_full_bytes += nbytes
        self.grad_full_peak_bytes = max(self.grad_full_peak_bytes, self.grad_full_bytes)

    def add_grad_shard(self, nbytes: int) -> None:
        self.grad_shard_bytes += nbytes
        self.grad_shard_peak_bytes = max(self.grad_shard_peak_bytes, self.grad_shard_bytes)

    def summary(self) -> dict:
        """Per-iteration figures (medians over measured iterations) and memory figures."""
        its = self.iterations
        med = (lambda k: statistics.median(it[k] for it in its)) if its else (lambda k: None)
        return {
            "num_allgathers_per_iteration": its[-1]["num_allgathers"] if its else None,
            # hpZ: of those, the ones within the rank's node group
            "num_allgathers_intra_group_per_iteration":
                its[-1]["num_allgathers_intra_group"] if its else None,
            "allgather_bytes_per_iteration": its[-1]["allgather_bytes"] if its else None,
            "fetch_host_s": med("fetch_host_s"), "release_host_s": med("release_host_s"),
            "wait_s": med("wait_s"), "bubble_s": med("bubble_s"),
            "gathered_peak_bytes": self.gathered_peak_bytes, "shard_bytes": self.shard_bytes,
            "persistent_bytes": self.persistent_bytes,
            "update_scratch_peak_bytes": self.scratch_peak_bytes,
            "hpz_secondary_peak_bytes": self.secondary_peak_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            # the most gradient shards held at once (all of them when the step starts)
            "grad_shard_bytes": self.grad_shard_peak_bytes,
            "grad_full_peak_bytes": self.grad_full_peak_bytes,
            "num_reduce_scatters_per_iteration":
                its[-1]["num_reduce_scatters"] if its else None,
            "reduce_scatter_bytes_per_iteration":
                its[-1]["reduce_scatter_bytes"] if its else None,
            "reduce_scatter_s": med("reduce_scatter_s"),
        }


def summarize_ranks(zs: list[dict]) -> dict | None:
    """The run's ``zero3`` summary from the ranks' ``zero3`` reports (None without any):
    counts and bytes per iteration as the largest rank's (ranks agree unless the traces
    differ), host and wait times (``summary()``'s ``*_s``) as the median rank's and the
    slowest rank's, memory as the largest rank's."""
    if not zs:
        return None
    out = {k: zs[0].get(k) for k in ("strategy", "world_size", "emulated", "prefetch",
                                     "hpz_partition_size", "leaf_modules", "num_params",
                                     "num_partitioned")}
    keys = list(Zero3Metrics().summary())  # the per-rank figures, in their order
    for key in (k for k in keys if not k.endswith("_s")):
        values = [z[key] for z in zs if z.get(key) is not None]
        out[key] = max(values) if values else None
    for key in (k for k in keys if k.endswith("_s")):
        values = [z[key] for z in zs if z.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        out[key[:-2] + "_max_s"] = max(values) if values else None
    out["modules"] = zs[0].get("modules", [])
    return out
