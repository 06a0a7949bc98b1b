"""Value ranges for integer tensors that ops read as indices, so synthetic data stays in bounds.

An index op (embedding, gather, nll_loss, max-pool backward, ...) reads an integer input as
positions into a sibling tensor. :func:`safe_int_bounds` derives the inclusive range those
values must take from the sibling shapes (and a few scalar arguments), and trusts the
trace's recorded ``tensor_range`` only inside that range: ranges are read before the op
runs, so an output buffer passed as input can carry garbage.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

# Integer tensors that feed no index op. Positive, because integer division and remainder
# by zero raise; 1 is a valid index into any dim of size >= 2, and counts or lengths of 1
# keep data-dependent outputs small. A constant fill is also the cheapest.
DEFAULT_INT_RANGE: tuple[int, int] = (1, 1)


class _Ctx:
    """Looks up recorded shapes and scalar values of one op call by argument name."""

    def __init__(self, arg_names, input_shapes, input_values, output_shapes):
        self.pos = {name: i for i, name in enumerate(arg_names)}
        self.shapes, self.values, self.out = input_shapes, input_values, output_shapes

    def shape(self, name):
        i = self.pos.get(name)
        shape = self.shapes[i] if i is not None and i < len(self.shapes) else None
        return tuple(shape) if isinstance(shape, (list, tuple)) and \
            all(isinstance(s, int) for s in shape) else None

    def value(self, name):
        i = self.pos.get(name)
        return self.values[i] if self.values and i is not None and i < len(self.values) else None

    def size(self, name, dim):
        """Size of dim ``dim`` of tensor ``name`` (negative dims wrap; a 0-d tensor has 1)."""
        shape = self.shape(name)
        if shape is None or not isinstance(dim, int) or isinstance(dim, bool):
            return None
        if not shape:
            return 1 if dim in (0, -1) else None
        return shape[dim] if -len(shape) <= dim < len(shape) else None


def _upto(n):
    """Indices into ``n`` items: [0, n-1]."""
    return None if n is None else (0, n - 1)


def _rows(ref):
    return lambda c, e: _upto(c.size(ref, 0))


def _along(ref, dim_arg="dim"):
    return lambda c, e: _upto(c.size(ref, c.value(dim_arg)))


def _numel(ref):
    return lambda c, e: None if c.shape(ref) is None else _upto(math.prod(c.shape(ref)))


def _count(arg):
    return lambda c, e: _upto(c.value(arg)) if isinstance(c.value(arg), int) else None


def _classes(ref):
    """Class targets: input is (N, C, ...) or (C,)."""
    return lambda c, e: None if c.shape(ref) is None else \
        _upto(c.size(ref, 1 if len(c.shape(ref)) >= 2 else 0))


def _plane(ref, num_dims):
    """Max-pool indices are flat offsets into the input's last ``num_dims`` dims."""
    def rule(c, e):
        shape = c.shape(ref)
        return None if shape is None or len(shape) < num_dims else \
            _upto(math.prod(shape[-num_dims:]))
    return rule


def _sizes_value(sizes_arg, dim_arg="dim"):
    def rule(c, e):
        sizes, dim = c.value(sizes_arg), c.value(dim_arg)
        ok = isinstance(sizes, (list, tuple)) and isinstance(dim, int) and \
            -len(sizes) <= dim < len(sizes)
        return _upto(sizes[dim]) if ok else None
    return rule


def _prod_value(arg):
    return lambda c, e: _upto(math.prod(c.value(arg))) \
        if isinstance(c.value(arg), (list, tuple)) else None


def _per_dim(ref, list_arg="indices"):
    """``self[indices]``: entry k of the index list indexes dim k of ``ref``."""
    def rule(c, e):
        i = c.pos.get(list_arg, len(c.shapes))
        entries = c.shapes[i] if i < len(c.shapes) else None
        dims = [e] if e is not None else range(len(entries) if isinstance(entries, list) else 0)
        sizes = [c.size(ref, d) for d in dims]
        return None if not sizes or None in sizes else _upto(min(sizes))
    return rule


def _take_along(c, e):
    return _numel("self")(c, e) if c.value("dim") is None else _along("self")(c, e)


def _classes_out(num_arg):
    """one_hot/bincount: values size the output; the recorded output shape tells how far."""
    def rule(c, e):
        num = c.value(num_arg)
        if num_arg == "num_classes" and isinstance(num, int) and num >= 0:
            return _upto(num)
        out = c.out[0] if c.out else None
        if isinstance(out, (list, tuple)) and out and isinstance(out[-1], int):
            return _upto(out[-1])
        return _upto(num) if isinstance(num, int) and num > 0 else None
    return rule


def _repeats(c, e):
    """Repeat counts: their sum sizes the output, so aim at the recorded output length."""
    out, reps, dim = (c.out[0] if c.out else None), c.shape("repeats"), c.value("dim")
    if not isinstance(out, (list, tuple)) or reps is None or \
            not all(isinstance(s, int) for s in out):
        return None
    if dim is None:  # the input is flattened
        length = math.prod(out)
    elif isinstance(dim, int) and -len(out) <= dim < len(out):
        length = out[dim]
    else:
        return None
    per = length // max(math.prod(reps), 1)
    # With an explicit output_size the sum must match exactly: use a constant count.
    return (per, per) if c.value("output_size") is not None else (0, per)


_OFFSETS = _numel("indices")  # bag starts: positions into indices
_EMBEDDING_BAG = {"indices": _rows("weight"), "offsets": _OFFSETS}
_BAG_BACKWARD = {"indices": _count("num_weights"), "offsets": _OFFSETS,
                 "offset2bag": _rows("grad"), "maximum_indices": _count("num_weights")}
_TARGET = {"target": _classes("self")}
_POOL2D, _POOL3D = {"indices": _plane("self", 2)}, {"indices": _plane("self", 3)}
_INDEX_LIST = {"indices": _per_dim("self")}
_DIM_INDEX = {"index": _along("self")}

# aten op base name (no overload, no trailing "_") -> {argument name: rule}.
_RULES = {
    "embedding": {"indices": _rows("weight")},
    "embedding_backward": {"indices": _count("num_weights")},
    "embedding_dense_backward": {"indices": _count("num_weights")},
    "embedding_sparse_backward": {"indices": _count("num_weights")},
    "embedding_renorm": {"indices": _rows("self")},
    "embedding_bag": _EMBEDDING_BAG, "_embedding_bag": _EMBEDDING_BAG,
    "_embedding_bag_forward_only": _EMBEDDING_BAG,
    "_embedding_bag_backward": _BAG_BACKWARD, "_embedding_bag_sparse_backward": _BAG_BACKWARD,
    "_embedding_bag_dense_backward": _BAG_BACKWARD,
    "_embedding_bag_per_sample_weights_backward": {
        "indices": _rows("weight"), "offsets": _OFFSETS, "offset2bag": _rows("grad")},
    "index_select": _DIM_INDEX, "index_select_backward": {"index": _sizes_value("self_sizes")},
    "gather": _DIM_INDEX, "scatter": _DIM_INDEX, "scatter_add": _DIM_INDEX,
    "scatter_reduce": _DIM_INDEX, "index_add": _DIM_INDEX, "index_copy": _DIM_INDEX,
    "index_fill": _DIM_INDEX, "index_reduce": _DIM_INDEX,
    "take": {"index": _numel("self")}, "put": {"index": _numel("self")},
    "take_along_dim": {"indices": _take_along},
    "index": _INDEX_LIST, "index_put": _INDEX_LIST, "_index_put_impl": _INDEX_LIST,
    "_unsafe_index": _INDEX_LIST, "_unsafe_index_put": _INDEX_LIST,
    "nll_loss": _TARGET, "nll_loss_nd": _TARGET, "nll_loss_forward": _TARGET,
    "nll_loss_backward": _TARGET, "nll_loss2d": _TARGET, "nll_loss2d_forward": _TARGET,
    "nll_loss2d_backward": _TARGET, "cross_entropy_loss": _TARGET,
    "multi_margin_loss": _TARGET, "multi_margin_loss_backward": _TARGET,
    "multilabel_margin_loss": _TARGET, "multilabel_margin_loss_forward": _TARGET,
    "multilabel_margin_loss_backward": _TARGET,
    "max_pool2d_with_indices_backward": _POOL2D, "adaptive_max_pool2d_backward": _POOL2D,
    "fractional_max_pool2d_backward": _POOL2D,
    "max_pool3d_with_indices_backward": _POOL3D, "adaptive_max_pool3d_backward": _POOL3D,
    "fractional_max_pool3d_backward": _POOL3D,
    "max_unpool2d": {"indices": _prod_value("output_size")},
    "max_unpool3d": {"indices": _prod_value("output_size")},
    "one_hot": {"self": _classes_out("num_classes")},
    "bincount": {"self": _classes_out("minlength")},
    "repeat_interleave": {"repeats": _repeats},
}
# Inputs that must also be non-decreasing (bag offsets start at 0 and never go back).
_MONOTONIC = frozenset({"offsets"})


def _rule_for(op_name: str, schema_args, position: int):
    """(rule or None, argument names of the op)."""
    namespace, _, rest = op_name.partition("::")
    base, _, overload = rest.partition(".")
    rules = _RULES.get(base[:-1] if base.endswith("_") and not base.endswith("__") else base)
    if namespace != "aten" or rules is None:
        return None, ()
    names = tuple(a.name for a in schema_args) if schema_args is not None \
        else _live_arg_names(base, overload)
    return (rules.get(names[position]) if 0 <= position < len(names) else None), names


@lru_cache(maxsize=1024)
def _live_arg_names(base: str, overload: str) -> tuple[str, ...]:
    """Argument names from this torch's schema, for callers without the recorded schema.

    Index arguments sit at the same position in every overload of the ops above, so the
    default (or first) overload stands in when the overload is unknown.
    """
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return ()
    names = packet.overloads()
    chosen = overload if overload in names else "default" if "default" in names else names[0]
    return tuple(a.name for a in getattr(packet, chosen)._schema.arguments)


def safe_int_bounds(op_name: str, schema_args, position: int, input_shapes: list,
                    recorded_range: tuple | None, input_values: list | None = None,
                    element: int | None = None,
                    output_shapes: list | None = None) -> tuple[int, int] | None:
    """Inclusive [lo, hi] an integer input must take so that the op cannot index out of bounds.

    ``op_name`` is ``"aten::name[.overload]"``; ``schema_args`` the recorded schema's args
    (``OpSchema.args``; None falls back on this torch's schema of the op);
    ``input_shapes``/``input_values`` are per input position (values give dims and sizes);
    ``element`` picks one tensor of a tensor-list input (``index.Tensor``'s indices).
    Returns None when the input is not an index of this op. Otherwise the recorded range
    clamped to the shape-derived bound, the bound itself when the recorded range is absent
    or disjoint from it, or (0, 0) when no bound can be derived.
    """
    rule, names = _rule_for(op_name, schema_args, position)
    if rule is None:
        return None
    ctx = _Ctx(names, input_shapes or [], input_values, output_shapes)
    bound = rule(ctx, element)
    if bound is None or bound[1] < bound[0]:
        return (0, 0)
    if recorded_range is not None and len(recorded_range) == 2:
        lo, hi = max(int(recorded_range[0]), bound[0]), min(int(recorded_range[1]), bound[1])
        if lo <= hi:
            return (lo, hi)
    return bound


def is_monotonic_input(op_name: str, schema_args, position: int) -> bool:
    """True when the input must also be non-decreasing (fill with ``monotonic=True``)."""
    rule, names = _rule_for(op_name, schema_args, position)
    return rule is not None and names[position] in _MONOTONIC


def int_fill_range(op_name: str, schema_args, position: int, input_shapes: list,
                   recorded_range: tuple | None, input_values: list | None = None,
                   element: int | None = None,
                   output_shapes: list | None = None) -> tuple[int, int]:
    """The range to fill any integer input with: its index bounds, else DEFAULT_INT_RANGE.

    A recorded range is not trusted outside index inputs: nothing bounds it there, and an
    output buffer's range is garbage.
    """
    bound = safe_int_bounds(op_name, schema_args, position, input_shapes, recorded_range,
                            input_values, element, output_shapes)
    return DEFAULT_INT_RANGE if bound is None else bound


def fill_int_tensor(t: torch.Tensor, lo: int, hi: int, monotonic: bool = False) -> torch.Tensor:
    """Fill ``t`` in place with integers in [lo, hi] (clipped to its dtype); no-op on meta.

    Uniform random values, or with ``monotonic`` an evenly spaced non-decreasing ramp that
    starts at ``lo`` (bag offsets). Works on any device.
    """
    n = t.numel()
    if t.device.type == "meta" or n == 0:
        return t
    if t.dtype == torch.bool:
        lo, hi = max(lo, 0), min(hi, 1)
    else:
        info = torch.iinfo(t.dtype)
        lo, hi = max(lo, info.min), min(hi, info.max, 2**63 - 2)  # hi + 1 must fit int64
    hi = max(hi, lo)
    if lo == hi:
        return t.fill_(lo)
    if monotonic:
        span = hi - lo + 1
        ramp = torch.arange(n, device=t.device, dtype=torch.int64)
        ramp = ramp * (span // n) if span >= n else (ramp * span) // n
        return t.copy_((ramp + lo).view(t.shape))
    return t.random_(lo, hi + 1)
