"""Index safety: integer inputs filled within safe_int_bounds never make an index op fail."""
import pytest
import torch

from actors.replay.ops.index_safety import (DEFAULT_INT_RANGE, fill_int_tensor, int_fill_range,
                                        is_monotonic_input, safe_int_bounds)
from actors.replay.ops.resolve import ResolvedOp, resolve_op

aten = torch.ops.aten
GARBAGE = (-(10**9), 10**12)  # what an uninitialized output buffer's recorded range looks like


class Idx:
    """An integer input the harness fills; ``shape`` as the trace records it."""

    def __init__(self, *shape, dtype=torch.int64):
        self.shape, self.dtype = list(shape), dtype


def f(*shape):
    return torch.randn(*shape)


def _lsm(*shape):
    return torch.randn(*shape).log_softmax(1)


# (overload, recorded input values, recorded output shapes, expected fill range per Idx).
# The expected ranges are written out because some ops (embedding_dense_backward) do not
# check their indices at all: only the exact range proves those safe.
CASES = [
    (aten.embedding.default, [f(10, 4), Idx(5, 3), -1, False, False], None, [(0, 9)]),
    (aten.embedding_dense_backward.default, [f(5, 3, 4), Idx(5, 3), 10, -1, False], None,
     [(0, 9)]),
    (aten.embedding_backward.default, [f(5, 3, 4), Idx(5, 3), 10, -1, False, False], None,
     [(0, 9)]),
    (aten.embedding_renorm_.default, [f(10, 4), Idx(6), 1.0, 2.0], None, [(0, 9)]),
    (aten._embedding_bag.default, [f(10, 4), Idx(7), Idx(3), False, 0, False, None, False, -1],
     None, [(0, 9), (0, 6)]),
    (aten._embedding_bag.default, [f(10, 4), Idx(9), Idx(4), False, 2, False, None, True, -1],
     None, [(0, 9), (0, 8)]),
    (aten._embedding_bag_forward_only.default,
     [f(10, 4), Idx(7, dtype=torch.int32), Idx(3, dtype=torch.int32), False, 1], None,
     [(0, 9), (0, 6)]),
    (aten._embedding_bag_dense_backward.default,
     [f(3, 4), Idx(7), Idx(7), Idx(3), Idx(3, 4), 10, False, 0, None, -1], None,
     [(0, 9), (0, 2), DEFAULT_INT_RANGE, (0, 9)]),
    (aten._embedding_bag_per_sample_weights_backward.default,
     [f(3, 4), f(10, 4), Idx(7), Idx(3), Idx(7), 0, -1], None, [(0, 9), (0, 6), (0, 2)]),
    (aten.index_select.default, [f(4, 6, 5), 1, Idx(8)], None, [(0, 5)]),
    (aten.index_select.default, [f(4, 6, 5), -1, Idx(8, dtype=torch.int32)], None, [(0, 4)]),
    (aten.index_select.default, [torch.tensor(2.0), 0, Idx(1)], None, [(0, 0)]),
    (aten.index_select_backward.default, [f(4, 8, 5), [4, 6, 5], 1, Idx(8)], None, [(0, 5)]),
    (aten.gather.default, [f(4, 6), 1, Idx(4, 3)], None, [(0, 5)]),
    (aten.gather.default, [f(4, 6), 0, Idx(2, 6)], None, [(0, 3)]),
    (aten.scatter.src, [f(4, 6), 1, Idx(4, 3), f(4, 3)], None, [(0, 5)]),
    (aten.scatter_.value, [f(4, 6), 0, Idx(3, 6), 1.5], None, [(0, 3)]),
    (aten.scatter_add.default, [f(4, 6), -1, Idx(4, 3), f(4, 3)], None, [(0, 5)]),
    (aten.scatter_reduce.two, [f(4, 6), 1, Idx(4, 3), f(4, 3), "amax", True], None, [(0, 5)]),
    (aten.index_add.default, [f(5, 3), 0, Idx(4), f(4, 3), 1], None, [(0, 4)]),
    (aten.index_copy.default, [f(5, 3), 1, Idx(3), f(5, 3)], None, [(0, 2)]),
    (aten.index_fill.int_Scalar, [f(5, 3), 0, Idx(4), 0.5], None, [(0, 4)]),
    (aten.take.default, [f(3, 4), Idx(6)], None, [(0, 11)]),
    (aten.put_.default, [f(3, 4), Idx(5), f(5), True], None, [(0, 11)]),
    (aten.take_along_dim.default, [f(4, 6), Idx(4, 2), 1], None, [(0, 5)]),
    (aten.take_along_dim.default, [f(4, 6), Idx(5), None], None, [(0, 23)]),
    (aten.index.Tensor, [f(5, 6, 7), [Idx(3), Idx(3)]], None, [(0, 4), (0, 5)]),
    (aten.index_put_.default, [f(5, 6, 7), [Idx(4)], f(4, 6, 7), False], None, [(0, 4)]),
    (aten._index_put_impl_.default, [f(5, 6), [Idx(2), Idx(2)], f(2), True, False], None,
     [(0, 4), (0, 5)]),
    (aten._unsafe_index.Tensor, [f(5, 6), [None, Idx(3)]], None, [(0, 5)]),
    (aten.nll_loss_forward.default, [_lsm(4, 5), Idx(4), None, 1, -100], None, [(0, 4)]),
    (aten.nll_loss_forward.default, [_lsm(1, 5)[0], Idx(), None, 1, -100], None, [(0, 4)]),
    (aten.nll_loss_nd.default, [_lsm(2, 5, 3), Idx(2, 3), None, 1, -100], None, [(0, 4)]),
    (aten.nll_loss2d_forward.default, [_lsm(2, 5, 3, 3), Idx(2, 3, 3), None, 1, -100], None,
     [(0, 4)]),
    (aten.nll_loss_backward.default,
     [torch.tensor(1.0), _lsm(4, 5), Idx(4), None, 1, -100, torch.tensor(4.0)], None, [(0, 4)]),
    (aten.cross_entropy_loss.default, [f(4, 5), Idx(4), None, 1, -100, 0.0], None, [(0, 4)]),
    (aten.multi_margin_loss.default, [f(4, 5), Idx(4), 1, 1.0, None, 1], None, [(0, 4)]),
    (aten.multilabel_margin_loss_forward.default, [f(4, 5), Idx(4, 5), 1], None, [(0, 4)]),
    (aten.max_pool2d_with_indices_backward.default,
     [f(1, 2, 2, 2), f(1, 2, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, Idx(1, 2, 2, 2)], None,
     [(0, 15)]),
    (aten.max_pool3d_with_indices_backward.default,
     [f(1, 1, 2, 2, 2), f(1, 1, 4, 4, 4), [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False,
      Idx(1, 1, 2, 2, 2)], None, [(0, 63)]),
    (aten.adaptive_max_pool2d_backward.default, [f(1, 2, 2, 2), f(1, 2, 4, 4), Idx(1, 2, 2, 2)],
     None, [(0, 15)]),
    (aten.fractional_max_pool2d_backward.default,
     [f(1, 2, 2, 2), f(1, 2, 5, 5), [2, 2], [2, 2], Idx(1, 2, 2, 2)], None, [(0, 24)]),
    (aten.max_unpool2d.default, [f(1, 2, 2, 2), Idx(1, 2, 2, 2), [4, 4]], None, [(0, 15)]),
    (aten.one_hot.default, [Idx(5), 6], None, [(0, 5)]),
    (aten.one_hot.default, [Idx(5), -1], [[5, 7]], [(0, 6)]),
    (aten.bincount.default, [Idx(6), None, 0], [[9]], [(0, 8)]),
    (aten.repeat_interleave.Tensor, [Idx(4), 12], [[12]], [(3, 3)]),
    (aten.repeat_interleave.Tensor, [Idx(4)], [[10]], [(0, 2)]),
    (aten.repeat_interleave.self_Tensor, [f(3, 2), Idx(3), 0, 9], [[9, 2]], [(3, 3)]),
]


def _schema_args(overload):
    r = resolve_op(overload.name().partition(".")[0], str(overload._schema))
    assert isinstance(r, ResolvedOp), r
    return r


def _shapes(values):
    """Input shapes as an ET records them: tensors, lists of tensors, and [] for scalars."""
    def one(v):
        if isinstance(v, Idx):
            return v.shape
        return list(v.shape) if isinstance(v, torch.Tensor) else None
    return [[one(e) for e in v] if isinstance(v, list) and any(
        isinstance(e, (Idx, torch.Tensor)) for e in v) else (one(v) or []) for v in values]


def _materialize(resolved, values, outs, recorded):
    """Fill every Idx within its range; return the concrete values and the ranges used."""
    name = f"{resolved.schema.namespace}::{resolved.schema.name}"
    args = resolved.schema.args
    shapes = _shapes(values)
    scalars = [None if isinstance(v, (Idx, torch.Tensor, list)) and not _is_int_list(v) else v
               for v in values]
    used = []

    def fill(idx, pos, element=None):
        lo, hi = int_fill_range(name, args, pos, shapes, recorded.get(pos), scalars, element,
                                outs)
        t = torch.empty(idx.shape, dtype=idx.dtype)
        fill_int_tensor(t, lo, hi, is_monotonic_input(name, args, pos))
        if t.numel():
            assert lo <= int(t.min()) and int(t.max()) <= hi
        used.append((pos, element, (lo, hi)))
        return t

    concrete = []
    for pos, v in enumerate(values):
        if isinstance(v, Idx):
            concrete.append(fill(v, pos))
        elif isinstance(v, list) and not _is_int_list(v):
            concrete.append([fill(e, pos, k) if isinstance(e, Idx) else e
                             for k, e in enumerate(v)])
        else:
            concrete.append(v.clone() if isinstance(v, torch.Tensor) else v)
    return concrete, used


def _is_int_list(v):
    return isinstance(v, list) and all(isinstance(e, int) for e in v)


@pytest.mark.parametrize("overload,values,outs,expected", CASES,
                         ids=[f"{c[0].name()}-{i}" for i, c in enumerate(CASES)])
def test_filled_within_bounds_the_op_runs(overload, values, outs, expected):
    resolved = _schema_args(overload)
    # A garbage recorded range is clamped to the same shape-derived bound.
    for recorded_value in (None, GARBAGE):
        recorded = {p: recorded_value for p, v in enumerate(values) if isinstance(v, Idx)}
        for _ in range(8):
            concrete, used = _materialize(resolved, values, outs, recorded)
            assert [u[2] for u in used] == expected
            args, kwargs = resolved.split_args(concrete)
            resolved.overload(*args, **kwargs)


def test_bounds_are_tight_the_next_value_fails():
    emb = _schema_args(aten.embedding.default)
    bound = safe_int_bounds("aten::embedding", emb.schema.args, 1, [[10, 4], [3]], None)
    assert bound == (0, 9)
    with pytest.raises(IndexError):
        aten.embedding.default(f(10, 4), torch.full((3,), 10))
    gather = _schema_args(aten.gather.default)
    assert safe_int_bounds("aten::gather", gather.schema.args, 2, [[4, 6], [], [4, 3]], None,
                           [None, 1, None]) == (0, 5)
    with pytest.raises(RuntimeError):
        aten.gather.default(f(4, 6), 1, torch.full((4, 3), 6))


def test_recorded_range_used_when_consistent_clamped_otherwise():
    args = _schema_args(aten.embedding.default).schema.args
    shapes = [[100, 16], [4, 8]]
    assert safe_int_bounds("aten::embedding", args, 1, shapes, (1, 96)) == (1, 96)
    assert safe_int_bounds("aten::embedding", args, 1, shapes, (-5, 200)) == (0, 99)
    assert safe_int_bounds("aten::embedding", args, 1, shapes, (500, 900)) == (0, 99)
    # No derivable bound (unknown sibling shape): the only safe value is 0.
    assert safe_int_bounds("aten::embedding", args, 1, [None, [4, 8]], (1, 96)) == (0, 0)
    nll = _schema_args(aten.nll_loss_forward.default).schema.args
    assert safe_int_bounds("aten::nll_loss_forward", nll, 1, [[8, 50], [8]], (-100, 49)) == \
        (0, 49)  # ignore_index in the recorded range


def test_non_index_inputs_get_the_default_range():
    args = _schema_args(aten.add.Tensor).schema.args
    assert safe_int_bounds("aten::add", args, 0, [[3], [3]], (2, 5)) is None
    assert int_fill_range("aten::add", args, 0, [[3], [3]], GARBAGE) == DEFAULT_INT_RANGE
    assert DEFAULT_INT_RANGE[0] >= 1  # never divides by zero
    assert safe_int_bounds("fbgemm::bounds_check_indices", (), 0, [], None) is None


def test_in_place_and_overload_names_and_missing_schema_args():
    args = _schema_args(aten.scatter_add_.default).schema.args
    assert safe_int_bounds("aten::scatter_add_", args, 2, [[4, 6], [], [4, 3], [4, 3]], None,
                           [None, 0, None, None]) == (0, 3)
    # Without the recorded schema the live default overload names the arguments.
    assert safe_int_bounds("aten::index_select", None, 2, [[4, 6], [], [8]], None,
                           [None, 1, None]) == (0, 5)
    assert is_monotonic_input("aten::_embedding_bag", None, 2)
    assert not is_monotonic_input("aten::_embedding_bag", None, 1)


def test_fill_int_tensor():
    t = torch.empty(1000, dtype=torch.int8)
    fill_int_tensor(t, -1000, 1000)
    assert int(t.min()) >= -128 and int(t.max()) <= 127 and len(t.unique()) > 100
    ramp = fill_int_tensor(torch.empty(10, dtype=torch.int64), 0, 3, monotonic=True)
    assert ramp[0] == 0 and bool((ramp[1:] >= ramp[:-1]).all()) and int(ramp.max()) <= 3
    wide = fill_int_tensor(torch.empty(5, dtype=torch.int64), 0, 10**6, monotonic=True)
    assert bool((wide[1:] > wide[:-1]).all())
    assert set(fill_int_tensor(torch.empty(50, dtype=torch.bool), -3, 9).tolist()) == {0, 1}
    big = fill_int_tensor(torch.empty(50, dtype=torch.uint64), 0, 2**64)
    assert big.numel() == 50
    base = torch.zeros(4, 6, dtype=torch.int64)
    fill_int_tensor(base[:, ::2], 7, 7)
    assert bool((base[:, ::2] == 7).all()) and bool((base[:, 1::2] == 0).all())
    meta = torch.empty(3, dtype=torch.int64, device="meta")
    assert fill_int_tensor(meta, 0, 5) is meta
    empty = torch.empty(0, dtype=torch.int64)
    assert fill_int_tensor(empty, 0, 5, monotonic=True).numel() == 0
