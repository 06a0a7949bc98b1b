"""Reserving the rank bundles (one Ray placement group): a bounded wait that gives up early
when the bundles cannot fit on the nodes alive.

After a node is lost, a sweep's next points may ask for more than the surviving nodes have;
Ray would keep such a placement group pending forever (waiting for nodes to join), and the
driver would wait out ``cluster.timeout_s`` for every such point. The alive nodes' total
resources are checked while waiting, and a request that cannot fit fails at once, saying what
the alive nodes hold and which nodes are dead.
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import RayError
from ray.util.placement_group import placement_group, remove_placement_group

from orchestrator.errors import ClusterError
from orchestrator.cluster.node_state import dead_nodes_text

_POLL_S = 1.0  # how often a pending placement is checked against the alive nodes


def reserve_bundles(bundle: dict, num_bundles: int, strategy: str, timeout_s: float):
    """A ready placement group of ``num_bundles`` copies of ``bundle``; ClusterError when it
    is not ready within ``timeout_s``, or as soon as it cannot fit on the alive nodes."""
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy)
    start = time.monotonic()
    deadline = start + timeout_s
    fits, totals = True, ""
    ready_ref = pg.ready()  # one check task in the group, polled (each call schedules another)
    while fits and time.monotonic() < deadline:
        wait_s = max(0.0, min(_POLL_S, deadline - time.monotonic()))
        ready, _ = ray.wait([ready_ref], timeout=wait_s)
        if ready:
            return pg
        fits, totals = bundles_fit(bundle, num_bundles, strategy)
    remove_placement_group(pg)
    what = f"could not reserve {num_bundles} bundles of {bundle} (placement_strategy={strategy})"
    if not fits:
        raise ClusterError(f"{what}: they cannot fit on the alive node(s) ({totals})"
                           f"{dead_nodes_text()}; gave up after {time.monotonic() - start:.1f} s "
                           f"of cluster.timeout_s={timeout_s:.1f} s")
    keys = sorted(bundle)
    total = {k: ray.cluster_resources().get(k, 0) for k in keys}
    free = {k: ray.available_resources().get(k, 0) for k in keys}
    num_nodes = sum(1 for n in ray.nodes() if n["Alive"])
    raise ClusterError(f"{what} within {timeout_s:.1f} s: the cluster has {total} in total and "
                       f"{free} available on {num_nodes} alive node(s){dead_nodes_text()}")


def bundles_fit(bundle: dict, num_bundles: int, strategy: str) -> tuple[bool, str]:
    """Whether ``num_bundles`` copies of ``bundle`` could ever be placed with ``strategy`` on
    the nodes alive now (by their total resources, busy or not), and the nodes' totals as
    text. A node Ray has not yet marked dead still counts: this only tells what cannot be."""
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
    except RayError:
        return True, "unknown"  # cannot tell: let the placement wait decide
    need = {k: v for k, v in bundle.items() if v > 0}
    per_node = [min((int(n["Resources"].get(k, 0) / v + 1e-9) for k, v in need.items()),
                    default=num_bundles) for n in nodes]
    if strategy == "STRICT_PACK":
        fits = max(per_node, default=0) >= num_bundles
    elif strategy == "STRICT_SPREAD":
        fits = sum(1 for c in per_node if c >= 1) >= num_bundles
    else:  # PACK, SPREAD: any split over the nodes
        fits = sum(per_node) >= num_bundles
    totals = ", ".join(f"{n['NodeManagerAddress']} {({k: n['Resources'].get(k, 0) for k in need})}"
                       for n in nodes)
    return fits, totals or "none"
