"""Op schema parsing, resolution to torch.ops overloads, and recorded-value conversions."""
import json

import pytest
import torch

from actors.errors import ReplayError
from actors.trace.op_schema import fresh_return_positions, parse_schema
from actors.replay.ops.resolve import (COLLECTIVE, SKIPPED, UNRESOLVED, ResolvedOp, Unresolved,
                                   resolve_op, skip_reason, to_device, to_dtype, to_layout,
                                   to_memory_format, torch_dtype)
from actors.trace.dtypes import (DTYPE_BY_CODE, ET_TYPE_TO_DTYPE, dtype_from_et_type,
                                 dtype_name, is_integral, itemsize_of)

ALLREDUCE = ("c10d::allreduce_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup "
             "process_group, __torch__.torch.classes.c10d.ReduceOp reduce_op, Tensor? "
             "sparse_indices, int timeout) -> (Tensor[], __torch__.torch.classes.c10d.Work)")
RANDINT = ("aten::randint.low(SymInt low, SymInt high, SymInt[] size, *, ScalarType? dtype=4, "
           "Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor")
LN_BWD = ("aten::native_layer_norm_backward(Tensor grad_out, Tensor input, SymInt[] "
          "normalized_shape, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, "
          "bool[3] output_mask) -> (Tensor, Tensor, Tensor)")
RANDOM_FROM = ("aten::random_.from(Tensor(a!) self, int from, int? to, *, "
               "Generator? generator=None) -> Tensor(a!)")
ADD = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"


def _write(alias_info) -> bool:
    return bool(alias_info is not None and alias_info.is_write)


def test_parses_every_schema_torch_knows_and_agrees_with_function_schema():
    schemas = torch._C._jit_get_all_schemas()
    assert len(schemas) > 3000
    for fs in schemas:
        text = str(fs)
        s = parse_schema(text)
        assert (s.qualified_name, s.overload) == (fs.name, fs.overload_name), text
        assert [a.name for a in s.args] == [a.name for a in fs.arguments], text
        assert [a.kwarg_only for a in s.args] == [a.kwarg_only for a in fs.arguments], text
        assert [a.has_default for a in s.args] == \
            [a.has_default_value() for a in fs.arguments], text
        assert [a.alias is not None for a in s.args] == \
            [a.alias_info is not None for a in fs.arguments], text
        assert [a.is_write for a in s.args] == [_write(a.alias_info) for a in fs.arguments]
        assert [r.name for r in s.returns] == [r.name for r in fs.returns], text
        assert [r.alias is not None for r in s.returns] == \
            [r.alias_info is not None for r in fs.returns], text
        assert [r.is_write for r in s.returns] == [_write(r.alias_info) for r in fs.returns]


def test_trace_examples():
    s = parse_schema(ADD)
    assert (s.namespace, s.name, s.overload) == ("aten", "add", "Tensor")
    assert [(a.name, a.type, a.kwarg_only, a.default) for a in s.args] == [
        ("self", "Tensor", False, None), ("other", "Tensor", False, None),
        ("alpha", "Scalar", True, "1")]
    s = parse_schema(RANDINT)
    assert [a.name for a in s.args if a.kwarg_only] == ["dtype", "layout", "device", "pin_memory"]
    assert s.args[3].type == "ScalarType?" and s.args[3].default == "4"
    s = parse_schema(LN_BWD)
    assert s.overload == "" and s.args[-1].type == "bool[3]" and len(s.returns) == 3
    assert fresh_return_positions(LN_BWD) == (True, True, True)
    s = parse_schema(RANDOM_FROM)
    assert (s.args[0].alias, s.args[0].is_write, s.args[0].type) == ("a!", True, "Tensor")
    assert s.returns[0].is_write and fresh_return_positions(RANDOM_FROM) == (False,)
    s = parse_schema(ALLREDUCE)
    assert s.args[1].type == "__torch__.torch.classes.c10d.ProcessGroup"
    assert [r.type for r in s.returns] == ["Tensor[]", "__torch__.torch.classes.c10d.Work"]
    assert fresh_return_positions(ALLREDUCE) == (True, False)


def test_tricky_syntax():
    s = parse_schema('my_ns::op.v2(Tensor(a -> *) self, str pad="a, (b]", str q=\'x"y\', '
                     'int[2] stride=[1, 1], float eps=1e-05, float s=0., int d=-1, '
                     't[](a!) lst, Dict(str, Tensor) m, (int, Tensor)[] pairs) '
                     '-> (Tensor(a) values, Tensor indices)')
    assert s.namespace == "my_ns" and s.overload == "v2"
    assert [a.name for a in s.args] == ["self", "pad", "q", "stride", "eps", "s", "d", "lst",
                                        "m", "pairs"]
    assert s.args[0].alias == "a -> *" and not s.args[0].is_write
    assert [a.default for a in s.args[1:7]] == ['"a, (b]"', "'x\"y'", "[1, 1]", "1e-05", "0.",
                                                 "-1"]
    assert (s.args[7].type, s.args[7].alias, s.args[7].is_write) == ("t[]", "a!", True)
    assert s.args[8].type == "Dict(str, Tensor)" and s.args[8].alias is None
    assert s.args[9].type == "(int, Tensor)[]"
    assert [(r.name, r.alias) for r in s.returns] == [("values", "a"), ("indices", None)]
    assert fresh_return_positions("aten::split.Tensor(Tensor(a -> *) self, SymInt split_size, "
                                  "int dim=0) -> Tensor(a)[]") == (False,)
    assert parse_schema("aten::_foreach_zero_(Tensor(a!)[] self) -> ()").returns == ()
    assert parse_schema("aten::format(str self, ...) -> str").is_vararg
    assert parse_schema("prim::TupleUnpack(Any tup) -> ...").is_varret


@pytest.mark.parametrize("text", [
    "", "aten::add", "aten::add(Tensor self", "aten::add(Tensor self) Tensor",
    "aten::add(Tensor) -> Tensor", "aten::add(Tensor self,, Tensor other) -> Tensor",
    'aten::x(str s="open) -> Tensor', "aten::x(int a=) -> Tensor", "aten::x(int a) ->",
    "aten::x(int a) -> (Tensor", "aten::x(int a]) -> Tensor", "a b::x(int a) -> Tensor",
    "aten::x(Tensor self, ..., int b) -> Tensor",
])
def test_malformed_schema_raises_with_text_and_fresh_positions_never_raise(text):
    with pytest.raises(ReplayError) as info:
        parse_schema(text)
    assert repr(text) in str(info.value)
    assert fresh_return_positions(text) == ()


def test_fresh_positions_tolerates_non_strings_and_caches():
    assert fresh_return_positions(None) == ()
    assert parse_schema(ADD) is parse_schema(ADD)


def test_resolves_to_the_right_overload():
    cases = {ADD: torch.ops.aten.add.Tensor, RANDINT: torch.ops.aten.randint.low,
             LN_BWD: torch.ops.aten.native_layer_norm_backward.default,
             RANDOM_FROM: torch.ops.aten.random_.__getattr__("from"),
             str(torch.ops.aten.empty.memory_format._schema): torch.ops.aten.empty.memory_format}
    for schema, expected in cases.items():
        r = resolve_op(schema.partition(".")[0].partition("(")[0], schema)
        assert isinstance(r, ResolvedOp) and r.overload is expected, schema
    r = resolve_op("aten::randint", RANDINT)
    assert r.num_positional == 3 and r.kwarg_names == ("dtype", "layout", "device", "pin_memory")
    assert resolve_op("aten::randint", RANDINT) is r  # cached


def test_unresolvable_ops_say_why():
    cases = {
        "nosuchns::op(Tensor self) -> Tensor": "unknown op namespace 'nosuchns'",
        "aten::no_such_op(Tensor self) -> Tensor": "not registered",
        "aten::add.NoSuch(Tensor self) -> Tensor": "no overload 'NoSuch'",
        "aten::add.Tensor(Tensor self, Tensor other, int extra) -> Tensor": "this torch's",
        "aten::add_(Tensor self) -> Tensor": "no overload 'default'",
        "aten::add.Tensor(Tensor self -> Tensor": "malformed op schema",
    }
    for schema, why in cases.items():
        r = resolve_op("aten::x", schema)
        assert isinstance(r, Unresolved) and r.kind == UNRESOLVED and why in r.reason, r


def test_schema_drift_with_defaulted_new_args_still_binds():
    # A trace from a torch whose add.Tensor had no alpha: the live default fills it in.
    r = resolve_op("aten::add", "aten::add.Tensor(Tensor self, Tensor other) -> Tensor")
    assert isinstance(r, ResolvedOp) and r.num_positional == 2 and r.kwarg_names == ()
    a, b = torch.ones(2), torch.full((2,), 3.0)
    args, kwargs = r.split_args([a, b])
    assert torch.equal(r.overload(*args, **kwargs), a + b)


def test_split_args_puts_kwarg_only_values_into_kwargs():
    r = resolve_op("aten::add", ADD)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    args, kwargs = r.split_args([a, b, 3])
    assert args == (a, b) and kwargs == {"alpha": 3}
    assert torch.equal(r.overload(*args, **kwargs), a + 3 * b)
    r = resolve_op("aten::randint", RANDINT)
    args, kwargs = r.split_args([0, 5, [2, 3], 6])  # trailing kwargs missing
    assert args == (0, 5, [2, 3]) and kwargs == {"dtype": 6}
    out = r.overload(*args, **{k: to_dtype(v) for k, v in kwargs.items()})
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    with pytest.raises(ReplayError, match="5 recorded values"):
        resolve_op("aten::add", ADD).split_args([a, b, 1, 2, 3])


def test_skip_list():
    assert resolve_op("c10d::allreduce_", ALLREDUCE).kind == COLLECTIVE
    assert skip_reason("record_param_comms").kind == COLLECTIVE
    assert skip_reason("gloo:all_reduce").kind == COLLECTIVE
    fc = str(torch.ops._c10d_functional.all_reduce.default._schema)
    assert resolve_op("_c10d_functional::all_reduce", fc).kind == COLLECTIVE
    enter = str(torch.ops.profiler._record_function_enter_new.default._schema)
    assert resolve_op("profiler::_record_function_enter_new", enter).kind == SKIPPED
    assert resolve_op("autograd::engine::evaluate_function: MmBackward0", "").kind == SKIPPED
    assert resolve_op("## forward ##", "").kind == SKIPPED
    assert resolve_op("torch::autograd::AccumulateGrad", "").kind == SKIPPED
    storage = str(torch.ops.aten.set_.source_Storage._schema)
    assert "Storage" in resolve_op("aten::set_", storage).reason
    assert resolve_op("aten::_assert_async",
                      str(torch.ops.aten._assert_async.default._schema)).kind == SKIPPED
    # Ops that merely take a Generator replay normally.
    assert isinstance(resolve_op("aten::random_", RANDOM_FROM), ResolvedOp)
    assert skip_reason("aten::mm", "aten::mm(Tensor self, Tensor mat2) -> Tensor") is None


def test_ops_without_schema_resolve_only_when_unambiguous():
    assert resolve_op("aten::relu", "").overload is torch.ops.aten.relu.default
    assert "candidate overloads" in resolve_op("aten::add", "").reason


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A real ET: torch.empty per dtype, and clone per memory format."""
    from torch.profiler import ExecutionTraceObserver
    dtypes = [getattr(torch, n) for n in ("float32", "float64", "float16", "bfloat16", "int8",
                                          "uint8", "int16", "int32", "int64", "bool",
                                          "complex64", "complex128", "uint16", "uint32",
                                          "uint64", "float8_e4m3fn", "float8_e5m2")]
    formats = [torch.contiguous_format, torch.preserve_format, torch.channels_last]
    path = tmp_path_factory.mktemp("et") / "dtypes.json"
    et = ExecutionTraceObserver()
    et.register_callback(str(path))
    et.start()
    for dt in dtypes:
        torch.empty(3, dtype=dt, layout=torch.strided).clone()
    x = torch.empty(2, 3, 4, 5)
    for mf in formats:
        x.clone(memory_format=mf)
    et.stop()
    et.unregister_callback()
    nodes = sorted(json.loads(path.read_text())["nodes"], key=lambda n: n["id"])
    return dtypes, formats, nodes


def test_dtype_tables_match_what_torch_records(captured):
    dtypes, formats, nodes = captured
    empties = [n for n in nodes if n["name"] == "aten::empty"][:len(dtypes)]
    clones = [n for n in nodes if n["name"] == "aten::clone"]
    for dt, empty, clone in zip(dtypes, empties, clones):
        name = str(dt).removeprefix("torch.")
        code = empty["inputs"]["values"][1]
        assert DTYPE_BY_CODE[code] == name and to_dtype(code) is dt
        assert to_layout(empty["inputs"]["values"][2]) is torch.strided
        et_type = clone["inputs"]["types"][0]
        assert dtype_from_et_type(et_type) == name, et_type
        assert to_dtype(et_type.removeprefix("Tensor(")[:-1]) is dt
        assert itemsize_of(name) == dt.itemsize == clone["inputs"]["values"][0][4]
    recorded = [n["inputs"]["values"][1] for n in clones[len(dtypes):]]
    assert [to_memory_format(c) for c in recorded] == formats


def test_dtype_names_are_torch_dtypes_with_matching_sizes():
    for name in DTYPE_BY_CODE + tuple(ET_TYPE_TO_DTYPE.values()):
        assert itemsize_of(name) == torch_dtype(name).itemsize, name
    assert is_integral("int64") and is_integral("uint8") and not is_integral("bool")
    assert is_integral("bool", include_bool=True) and not is_integral("float32")
    assert itemsize_of(None) == 0 and dtype_from_et_type("Tensor(nullptr (uninitialized))") is None
    assert dtype_name("Float") == "float32" and dtype_name("torch.bfloat16") == "bfloat16"
    assert to_dtype("long") is torch.int64 and to_dtype(None) is None
    with pytest.raises(ReplayError, match="unknown dtype 999"):
        to_dtype(999)
    with pytest.raises(ReplayError, match="layout code 42"):
        to_layout(42)


def test_device_remapping_always_gives_the_replay_device():
    for recorded in ("cuda:1", "cuda", "cpu", None, torch.device("cuda", 3)):
        assert to_device(recorded, "meta") == torch.device("meta")
        assert to_device(recorded, torch.device("cpu")) == torch.device("cpu")
