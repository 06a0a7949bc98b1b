"""torch's everyday training idioms on ``workload.device=fake``: the branch a real cpu run takes,
or a clear refusal.

A fake tensor has a shape but no value, and its type is ``FakeTensor``. torch's own code
branches on both, so left alone a fake step would run another program than the real one, or
stop deep inside torch:

* **deepcopy.** ``Tensor.__deepcopy__`` clones a fake tensor when its data pointer is 0 and
  otherwise copies its storage as a real tensor's (the capture's unique meta storages give
  every fake tensor a data pointer), and in both cases deep-copies the tensor's ``__dict__``,
  where the fake mode keeps the real value of a small tensor it tracks (``torch.tensor(0)``:
  BatchNorm's ``num_batches_tracked``): copying that real tensor inside the mode fails, so
  ``AveragedModel(model)`` (an EMA copy) did. Within the capture a fake tensor deep-copies by
  ``clone``, its tracked value with it (the copy's mode: ``CaptureFakeMode.__deepcopy__``).
* **nn.init.trunc_normal_** (ViT, ConvNeXt, Swin) resamples until every value lies in its
  bounds, reading the values (``mask.any()``); torch skips it on meta tensors (nothing to
  sample), and on fake, whose tensors are meta ones, it is skipped too. Initial values are
  not part of a trace (the model is built before the recorded step); torch's other value-free
  inits run as they are.
* **foreach paths.** ``clip_grad_norm_``, ``clip_grad_value_`` and the optimizers take the
  multi-tensor path only for tensors whose exact type is in torch's ``_foreach_supported_types``
  lists (``type(t) in [Tensor, Parameter]``), so on fake they silently fall back to one op per
  tensor. :func:`torch_idioms_on_fake` adds ``FakeTensor`` to both lists, as DTensor adds itself
  at import: a fake tensor stands for a plain one. (One case stays apart: ``torch.utils``'s list
  holds ``Tensor`` but not ``Parameter``, so a foreach check there on the parameters
  themselves, rather than their gradients, takes the foreach path on fake only.)
* **GradScaler's found-inf check.** ``GradScaler.step`` reads the flags
  ``_amp_foreach_non_finite_check_and_unscale_`` wrote (``found_inf.item()``) to decide
  whether the optimizer steps. On fake the flags are read as 0: the step with finite
  gradients, the one that updates the weights and holds the optimizer's memory. The
  unscale, the checks and the ``.item()`` themselves run and are recorded as on cpu.
* **nn.Transformer*'s causal-mask check.** Given a mask and no ``is_causal`` hint,
  ``nn.TransformerEncoder``, ``TransformerDecoderLayer`` and ``nn.Transformer`` compare the mask
  with a causal one and read the result (``bool((mask == causal).all())``), which decides
  whether attention takes ``is_causal`` or the mask. On fake, a mask made by
  ``nn.Transformer.generate_square_subsequent_mask`` is known to be causal: the comparison
  runs and is recorded, and its read answers True, as on cpu. Any other mask without a hint is
  refused, naming the hint to pass.
* **module.to(device) where the parameters already are.** torch swaps every fake parameter
  with its converted copy (``torch.utils.swap_tensors``), which refuses a tensor something holds
  a weak reference to (DeepSpeed's engine names every parameter through a weak map, then moves
  the model to its device). A move that converts nothing keeps the parameter, as on cpu.
* **Any other value read** (``.item()``, ``float(t)``, ``if t > 0``: the loss for logging,
  LBFGS's line search, ASGD's ``mu.item()``, Adafactor's ``param.norm().item()``), an op
  whose output shape depends on values (``nonzero``, ``masked_select``, boolean indexing,
  ``pack_padded_sequence``) or a sparse tensor (its number of stored elements) cannot be
  answered from shapes, nor can a torch.compile backend that needs real values (inductor
  itself runs on fake: actors/capture/fake/compiled_on_fake.py): :func:`fake_step_error` turns
  torch's exception into a ConfigError naming what and the line that asked.
"""
from __future__ import annotations

import copy
import os
import traceback
from contextlib import ExitStack, contextmanager

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor)

from actors.capture.readable import VALUE_ATTR
from actors.capture.fake.cuda_flex_attention import EagerFlexOnFake
from actors.capture.fake.fake_mode import SparseOnFake, answering_next_read
from actors.errors import ConfigError

_TORCH_DIR = os.path.dirname(torch.__file__)
_TENSOR_DEEPCOPY = torch.Tensor.__deepcopy__
# the capture's own frames (the recorder, the fake device, the workloads): actors/capture/
_CAPTURE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
FINITE = 0.0  # what a found-inf flag reads on fake: no inf or NaN in the gradients


@contextmanager
def _appended(types: list, new_type: type):
    """``new_type`` in the list ``types`` within the block (removed after, if added here)."""
    added = new_type not in types
    if added:
        types.append(new_type)
    try:
        yield
    finally:
        if added:
            types.remove(new_type)


@contextmanager
def _finite_grad_scaler():
    """Within the block, GradScaler reads every found-inf flag as FINITE (module docstring)."""
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler._maybe_opt_step

    def maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        for found_inf in optimizer_state["found_inf_per_device"].values():
            if isinstance(found_inf, FakeTensor):
                found_inf.item_memo = FINITE  # fake's .item() answers from it (this version)
        return original(self, optimizer, optimizer_state, *args, **kwargs)

    GradScaler._maybe_opt_step = maybe_opt_step
    try:
        yield
    finally:
        GradScaler._maybe_opt_step = original


@contextmanager
def _causal_masks_known():
    """Within the block, nn.Transformer*'s check whether a fake mask is causal answers from how
    the mask was made (module docstring)."""
    import torch.nn.modules.transformer as transformer

    generate = transformer._generate_square_subsequent_mask
    detect = transformer._detect_is_causal_mask

    def generate_causal(sz, device=None, dtype=None):
        mask = generate(sz, device=device, dtype=dtype)
        if isinstance(mask, FakeTensor):
            mask.tracefleet_causal_size = sz
        return mask

    def detect_causal(mask, is_causal=None, size=None):
        if is_causal is not None or not isinstance(mask, FakeTensor):
            return detect(mask, is_causal, size)
        sz = size if size is not None else mask.size(-2)
        if tuple(mask.shape) != (sz, sz):
            return detect(mask, is_causal, size)  # False without reading the mask
        if getattr(mask, "tracefleet_causal_size", None) != sz:
            raise ConfigError(
                f"workload.device=fake: nn.Transformer* got a {sz}x{sz} attention mask and no "
                "is_causal hint, and reads the mask's values to tell whether it is causal; "
                "fake tensors have no values: pass is_causal=True or False with the mask (the "
                "encoder's is_causal, the decoder's tgt_is_causal / memory_is_causal), or make "
                "it with nn.Transformer.generate_square_subsequent_mask")
        with answering_next_read(True):
            return detect(mask, is_causal, size)

    transformer._generate_square_subsequent_mask = generate_causal
    transformer._detect_is_causal_mask = detect_causal
    try:
        yield
    finally:
        transformer._generate_square_subsequent_mask = generate
        transformer._detect_is_causal_mask = detect


def _deepcopy_fake(self, memo):
    """``Tensor.__deepcopy__``'s branch for a storage-less tensor subclass (which torch takes for
    a fake tensor whose data pointer is 0; the capture's unique meta storages give it one),
    keeping the real value of a constant out of the deep copy."""
    if id(self) in memo:
        return memo[id(self)]
    if not self.is_leaf:
        return _TENSOR_DEEPCOPY(self, memo)  # torch's refusal of a non-leaf tensor
    with torch.no_grad():
        new = self.clone()
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        self._clear_non_serializable_cached_data()
        # The mode copies as itself; a real value the mode keeps (``constant``, or the known
        # value of actors/capture/fake/fake_values.py) is the clone's own: deep-copying that real
        # tensor inside the mode would fake its copy.
        state = {k: v for k, v in self.__dict__.items() if k not in ("constant", VALUE_ATTR)}
        new.__dict__.update(copy.deepcopy(state, memo))
    memo[id(self)] = new
    return new


@contextmanager
def _deepcopy_by_clone():
    """Within the block, ``copy.deepcopy`` of a fake tensor clones it (module docstring)."""
    own = FakeTensor.__dict__.get("__deepcopy__")  # None: FakeTensor inherits Tensor's
    FakeTensor.__deepcopy__ = _deepcopy_fake
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own


@contextmanager
def _init_skipped_like_meta():
    """Within the block, ``nn.init.trunc_normal_`` leaves a fake tensor as it leaves a meta one
    (module docstring)."""
    import torch.nn.init as init

    original = init._no_grad_trunc_normal_

    def trunc_normal(tensor, *args, **kwargs):
        if isinstance(tensor, FakeTensor):
            return tensor
        return original(tensor, *args, **kwargs)

    init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    # one storage object, told without its data pointer (a fake tensor's warns that it has none)
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and (a.shape, a.stride(), a.storage_offset(), a.dtype, a.device)
            == (b.shape, b.stride(), b.storage_offset(), b.dtype, b.device))


@contextmanager
def _no_op_moves_not_swapped():
    """``module.to(device)`` swaps every fake parameter with its converted copy
    (``torch.utils.swap_tensors``), which refuses a tensor something holds a weak reference to;
    DeepSpeed's engine keeps one to every parameter (its debug name map) and then moves the
    model to its device. A move to where the parameter already is converts nothing (cpu: the
    copy views the same storage, alike in every respect): that swap is skipped, as cpu's own
    path keeps the parameter in place."""
    import torch.utils

    original = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor) and _same_tensor(t1, t2) \
                and type(t1) is type(t2) and t1.requires_grad == t2.requires_grad:
            return None
        return original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextmanager
def torch_idioms_on_fake():
    """Within the block (around a fake capture), torch's idioms take the real cpu branch on
    fake tensors (see the module docstring)."""
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    with ExitStack() as stack:
        stack.enter_context(_appended(optimizer_module._foreach_supported_types, FakeTensor))
        stack.enter_context(_appended(foreach_utils._foreach_supported_types, FakeTensor))
        stack.enter_context(_finite_grad_scaler())
        stack.enter_context(_causal_masks_known())
        stack.enter_context(_deepcopy_by_clone())
        stack.enter_context(_init_skipped_like_meta())
        stack.enter_context(_no_op_moves_not_swapped())
        yield


def _site(frame: traceback.FrameSummary) -> str:
    code = f": `{frame.line.strip()}`" if frame.line else ""
    rel = os.path.relpath(frame.filename, _TORCH_DIR)
    path = frame.filename if rel.startswith("..") else os.path.join("torch", rel)
    return f"{path}:{frame.lineno} in {frame.name}{code}"


def _asking_frames(exc: BaseException) -> str:
    """Where the value was asked for: the two innermost frames outside torch's private modules
    (the fake mode, the tensor's dunder methods) and the capture's own code, and the innermost
    frame outside torch (the user's line, which may have called into torch)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_CAPTURE_DIR)]

    def in_torch(f):
        return not os.path.relpath(f.filename, _TORCH_DIR).startswith("..")

    def private(f):  # torch/_subclasses/..., torch/_tensor.py, torch/utils/_stats.py, ...
        parts = os.path.relpath(f.filename, _TORCH_DIR).split(os.sep)
        return in_torch(f) and (parts[0].startswith("_")
                                or parts[0] == "utils" and parts[-1].startswith("_"))

    public = [f for f in reversed(frames) if not private(f)][:2]  # innermost and its caller
    outside = next((f for f in reversed(frames) if not in_torch(f)), None)
    if not public:
        return "an unknown line"
    where = ", in ".join(_site(f) for f in public if f is not outside)
    if outside is not None:
        where += f"{', ' if where else ''}called from {_site(outside)}"
    return where


def _chain(exc: BaseException | None):
    """``exc`` and what caused it, outermost first (bounded: a cycle ends it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _flex_refusal(exc: BaseException) -> ConfigError | None:
    """FlexAttention's refusals on fake tensors: its backward on a CPU target (torch has no CPU
    kernel for it), its eager path on a GPU target (actors/capture/fake/cuda_flex_attention.py)."""
    for cause in _chain(exc):
        if isinstance(cause, EagerFlexOnFake):
            return ConfigError(f"workload.device=fake: {cause} (at {_asking_frames(cause)})")
        if isinstance(cause, NotImplementedError) and \
                str(cause).startswith("FlexAttention does not support backward on CPU"):
            return ConfigError(
                f"workload.device=fake: the step trains through FlexAttention (at "
                f"{_asking_frames(cause)}), whose backward torch {torch.__version__} runs on "
                "GPUs only, so a CPU cannot run this step. Predict it for a GPU: set "
                "workload.gpu_kernels (sm80, sm90, ...; tracefleet-predict sets it from "
                "target.arch) and the compiled FlexAttention is lowered as the GPU's Triton "
                "kernels")
    return None


def _compiled(exc: BaseException) -> bool:
    """Whether the exception went through torch.compile's machinery (dynamo, inductor)."""
    dirs = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("_dynamo", "_inductor"))
    return any(f.filename.startswith(dirs) for e in _chain(exc)
               for f in traceback.extract_tb(e.__traceback__))


def fake_step_error(exc: BaseException) -> ConfigError | None:
    """A ConfigError saying what a fake capture cannot do and where the step asked for it, when
    ``exc`` (or what caused it) is one of: a value read, an op whose output shape depends on
    values, a sparse tensor, torch.compile; None for any other exception."""
    keep_out = "keep the value out of the recorded step"
    for cause in _chain(exc):
        if isinstance(cause, DataDependentOutputException):
            what = (f"reads a tensor's value ({cause.func}: .item(), float(), int(), bool() or an "
                    "`if` on a tensor)")
            instead = keep_out
        elif isinstance(cause, DynamicOutputShapeException):
            what = f"runs an op whose output shape depends on tensor values ({cause.func})"
            instead = keep_out
        elif isinstance(cause, SparseOnFake):
            what = (f"makes a sparse tensor ({cause.func}: nn.Embedding/EmbeddingBag(sparse=True) "
                    "gradients, SparseAdam, torch.sparse), whose number of stored elements "
                    "depends on values")
            instead = "use dense gradients (sparse=False)"
        else:
            continue
        return ConfigError(f"workload.device=fake: the step {what} at {_asking_frames(cause)}; "
                           "fake tensors have shapes, not values: capture this step on "
                           f"workload.device=cpu or cuda, or {instead}")
    flex = _flex_refusal(exc)
    if flex is not None:
        return flex
    if _compiled(exc):
        root = list(_chain(exc))[-1]  # the backend's or kernel's own error
        first = next((line for line in str(root).splitlines() if line.strip()), "")[:300]
        return ConfigError(f"workload.device=fake: torch.compile raised {type(root).__name__} on "
                           f"fake tensors ({first}) at {_asking_frames(root)}; inductor's plan "
                           "runs on fake (actors/capture/fake/compiled_on_fake.py), a backend or "
                           "kernel that needs real values does not: capture the step with "
                           "backend='inductor' or 'aot_eager', without torch.compile, or on "
                           "workload.device=cpu or cuda")
    return None
