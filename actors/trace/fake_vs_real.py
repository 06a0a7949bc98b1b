"""Compare a fake capture of a training step with a real one of the same step (pure data): the
op histograms and, op by op in execution order, the names and output sizes, naming the first
place the two part (``tracefleet-capture workload.check_fake=true``,
orchestrator/run/fake_check.py).

What the real run does that no model code asks for is left out of both sides before comparing:

* work of the communication backend: ops on another thread than the step's (gloo's workers
  copy all-gather chunks there), and ops reading a storage a collective made inside itself
  (gloo builds reduce-scatter on all-reduce: the caller then splits the all-reduced copy,
  ``aten::chunk`` + ``aten::copy_``), with what they make of it. NCCL, which the fake process
  group stands for, does none of it;
* the autograd engine's accumulation of a gradient that several uses produce: in place on
  real tensors (``aten::add_``), out of place under any dispatch mode, fake included
  (``aten::add``: torch's ``isTensorSubclassLike``); both are read as one accumulation.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from actors.trace import collectives as coll
from actors.trace.loader import load_trace
from actors.trace.node_stream import read_json
from actors.trace.model import Op, Trace

ENGINE_FRAME = "autograd::engine::evaluate_function: "
ACCUMULATION = "gradient accumulation (aten::add / aten::add_)"
_IN_PLACE_ACCUMULATION = {"aten::add_": "aten::add"}


@dataclass
class OpView:
    """One compared op: its name as compared, where it ran and what it returned."""

    name: str
    node_id: int
    module: str
    output_bytes: tuple[int, ...]

    def describe(self) -> str:
        where = f" in {self.module}" if self.module else ""
        sizes = ", ".join(str(b) for b in self.output_bytes) or "none"
        return f"node {self.node_id} {self.name}{where} (output bytes: {sizes})"


@dataclass
class FakeCheck:
    """The comparison's outcome; ``equal`` when neither histogram nor sequence differs."""

    num_compared_real: int
    num_compared_fake: int
    histogram_diff: dict = field(default_factory=dict)  # op name -> [real count, fake count]
    first_divergence: dict | None = None  # {index, real, fake}: descriptions, None at an end
    num_backend_ops: int = 0  # real ops left out as the backend's own work
    num_accumulations: int = 0  # real in-place accumulations read as out-of-place ones

    @property
    def equal(self) -> bool:
        return not self.histogram_diff and self.first_divergence is None

    @classmethod
    def from_dict(cls, d: dict) -> "FakeCheck":
        """The check ``to_dict`` wrote."""
        return cls(d["num_compared_real"], d["num_compared_fake"], d["histogram_diff"],
                   d["first_divergence"], d["num_backend_ops"], d["num_accumulations"])

    def to_dict(self) -> dict:
        return {"equal": self.equal, "num_compared_real": self.num_compared_real,
                "num_compared_fake": self.num_compared_fake,
                "histogram_diff": self.histogram_diff, "first_divergence": self.first_divergence,
                "num_backend_ops": self.num_backend_ops,
                "num_accumulations": self.num_accumulations}


def _raw_context(path) -> tuple[dict, set]:
    """(node id -> parent name, storage ids made inside collectives) from the raw file."""
    nodes = read_json(path)["nodes"]
    by_id = {n.get("id"): n for n in nodes if isinstance(n, dict)}
    parent_name = {nid: by_id.get(n.get("ctrl_deps"), {}).get("name", "")
                   for nid, n in by_id.items()}
    inside: set[int] = set()
    children: dict = {}
    for nid, n in by_id.items():
        children.setdefault(n.get("ctrl_deps"), []).append(nid)
    for nid, n in by_id.items():
        if n.get("name") in coll.C10D_KINDS or n.get("name") == "record_param_comms":
            own = _storage_ids(n)
            stack = list(children.get(nid, ()))
            while stack:
                child = stack.pop()
                inside.update(s for s in _storage_ids(by_id[child], "outputs") if s not in own)
                stack.extend(children.get(child, ()))
    return parent_name, inside


def _storage_ids(node: dict, sides=("inputs", "outputs")) -> set[int]:
    found = set()
    for side in (sides,) if isinstance(sides, str) else sides:
        values = (node.get(side) or {}).get("values") or []
        stack = list(values)
        while stack:
            v = stack.pop()
            if isinstance(v, list) and len(v) == 6 and type(v[1]) is int:
                found.add(v[1])
            elif isinstance(v, list):
                stack.extend(v)
    return found


def _views(trace: Trace, parent_name: dict, backend_storages: set) -> tuple[list[OpView], int,
                                                                           int]:
    """The compared ops of ``trace`` (see the module docstring), how many backend ops were
    left out and how many in-place accumulations were renamed."""
    main = trace.ops[trace.steps[0].first].tid if trace.steps else (
        trace.ops[0].tid if trace.ops else 0)
    backend = set(backend_storages)
    views, num_backend, num_accumulations = [], 0, 0
    for op in trace.ops:
        inputs = {t.storage_id for t in op.input_tensors()}
        if op.tid != main or inputs & backend:
            backend.update(t.storage_id for t in op.output_tensors() if t.storage_id not in inputs)
            num_backend += 1
            continue
        name = op.name
        if name in _IN_PLACE_ACCUMULATION and parent_name.get(op.node_id, "").startswith(
                ENGINE_FRAME):
            name = _IN_PLACE_ACCUMULATION[name]
            num_accumulations += 1
        views.append(OpView(name, op.node_id, op.module, _output_bytes(op)))
    return views, num_backend, num_accumulations


def _output_bytes(op: Op) -> tuple[int, ...]:
    return tuple(t.numel * t.itemsize for t in op.output_tensors())


def compare_captures(real_path, fake_path) -> FakeCheck:
    """Compare the real capture's trace at ``real_path`` with the fake one at ``fake_path``
    (both of the same step and world size; rank 0's, say)."""
    sides = []
    for path in (real_path, fake_path):
        parent_name, inside = _raw_context(path)
        sides.append(_views(load_trace(path), parent_name, inside))
    (real, num_backend, num_acc), (fake, _, _) = sides
    hist_real, hist_fake = Counter(v.name for v in real), Counter(v.name for v in fake)
    diff = {name: [hist_real[name], hist_fake[name]]
            for name in sorted(set(hist_real) | set(hist_fake)) if hist_real[name] != hist_fake[name]}
    check = FakeCheck(len(real), len(fake), diff, None, num_backend, num_acc)
    for i in range(max(len(real), len(fake))):
        r = real[i] if i < len(real) else None
        f = fake[i] if i < len(fake) else None
        if r is None or f is None or r.name != f.name or r.output_bytes != f.output_bytes:
            check.first_divergence = {"index": i,
                                      "real": r.describe() if r else "(the real run ends)",
                                      "fake": f.describe() if f else "(the fake run ends)"}
            break
    return check
