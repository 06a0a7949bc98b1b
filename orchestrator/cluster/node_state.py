"""What Ray says about its nodes, in the words a failure needs: which nodes are dead and which
took ranks down with them.

A rank whose node dies surfaces in several ways (its actor dies, its peers' collectives break,
a later placement cannot be satisfied); each message names the node by IP and Ray node id so
the row of a sweep point says where the fault was, not only which ranks suffered it.
"""
from __future__ import annotations

import ray
from ray.exceptions import RayError

from orchestrator.cluster.rank_result import Outcome, Result


def lost_nodes(results: list[Result]) -> str | None:
    """One message naming each Ray node that took ranks down with it: a node where a rank's
    actor died, or that Ray already marks dead, with the ranks it held (``results`` from
    ``wait``); None when no node is to blame.

    A node that is killed is only marked dead once Ray's health checks give up on it (some
    seconds later), while its actors are reported dead at once: both are evidence.
    """
    dead = dead_node_ids()
    by_node: dict[tuple, list[int]] = {}
    for r in results:
        if not r.ok and (r.kind == Outcome.died or r.node_id in dead):
            by_node.setdefault((r.node_ip, r.node_id), []).append(r.rank)
    parts = []
    for (ip, node_id), ranks in by_node.items():
        node, ranks = f"Ray node {ip} (node id {node_id})", ", ".join(map(str, sorted(ranks)))
        parts.append(f"{node} is dead: rank(s) {ranks} ran there" if node_id in dead
                     else f"the actors of rank(s) {ranks} died on {node}")
    return "; ".join(parts) or None


def dead_node_ids() -> set[str]:
    """Ids of the nodes Ray marks dead."""
    return {n["NodeID"] for n in _dead_nodes()}


def dead_nodes_text() -> str:
    """``; dead node(s): <ip> (node id <id>), ...``, or "" when every node is alive."""
    dead = _dead_nodes()
    if not dead:
        return ""
    return "; dead node(s): " + ", ".join(f"{n['NodeManagerAddress']} (node id {n['NodeID']})"
                                           for n in dead)


def _dead_nodes() -> list[dict]:
    """Ray's records of its dead nodes (none when the GCS cannot be asked: this only words a
    message, it must not raise while another failure is being reported)."""
    try:
        return [n for n in ray.nodes() if not n["Alive"]]
    except RayError:
        return []
