"""Pipeline parallel on the Llama decoder with ``torch.distributed.pipelining``, as torchtitan
splits it (``pipeline_llama_manual_split``) and schedules it.

The ``pp x pp_stages_per_rank`` stages hold consecutive shares of the blocks (``stage_layers``);
the first also the token embedding, the last the final norm and the output projection, whose
logits the schedule's loss function takes. A rank holds stage ``s`` (its pp index) and, looped as
torchtitan's interleaved schedules, ``s + pp``, ``s + 2 pp``, ... Each stage keeps the model's
module names (``layers.<i>`` of the whole model), so the trace's module ranges read as the
unsplit model's.

A step is one ``schedule.step`` per grad-accumulation micro-batch over ``pp_microbatches``
micro-batches of ``batch_size`` samples: gpipe (every forward, then every backward), 1f1b
(after ``pp - 1 - s`` warm-up forwards, one forward one backward) or interleaved 1f1b over the
rank's stages; activations and their gradients go between neighbouring stages by send/recv on
the pp group. FSDP2 shards each stage (its blocks, then the stage), without resharding after
forward (torchtitan's default under pp: the micro-batches' forwards would all-gather again;
``workload.reshard_after_forward=always`` reshards); with no data-parallel ranks, nothing does.
The schedule's ``step`` returns the last stage's outputs (``return_outputs=True``, torch's
default, which torchtitan keeps): the stage holds every micro-batch's logits (vocabulary-sharded
under tp: loss parallel) until the step ends.
The stages' shapes are given to ``PipelineStage`` (no shape inference, which exchanges
pickled metadata the fake process group cannot carry).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from actors.capture.workloads.mesh import PipelineSchedule
from actors.capture.workloads.fsdp2 import offload_kwargs, reshards_after_forward
from actors.capture.workloads.optimizers import make_optimizer


class LlamaStage(nn.Module):
    """Blocks ``layer_ids`` of ``model`` (actors/capture/workloads/models/llama/model.py's Llama),
    with its embedding on the first stage and its norm and output on the last."""

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        # the whole tables (seq_len rows, cut by cp): a later stage's input is cut by sequence
        # parallel, its length not the sequence's
        cos, sin = self.rope_cos, self.rope_sin
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        return self.output(self.norm(h)).float()  # fp32 logits, as the unsplit model


class PipelineStages(nn.Module):
    """This rank's stages (``chunks.<k>`` keeps each stage's own names below it); the
    workload's model, whose submodules get the trace's module ranges."""

    def __init__(self, stages: list[LlamaStage]):
        super().__init__()
        self.chunks = nn.ModuleList(stages)


def stage_ids(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages a rank of pp index ``pp_rank`` holds (looped: s, s + pp, ...)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's blocks, torchtitan's rule (``generate_llm_fqn_per_model_part``): the
    embedding and the output count one block each, the ``num_layers + 2`` units are shared
    out evenly, the first stages taking one more of the remainder (Llama 3.1 405B's 126 blocks
    over 8 stages: 15, 16 x 6, 15)."""
    units = num_layers + 2
    out, start = [], 0
    for s in range(num_stages):
        n = units // num_stages + (1 if s < units % num_stages else 0)
        n -= (s == 0) + (s == num_stages - 1)
        out.append(range(start, start + n))
        start += n
    return out


def split_model(model: nn.Module, pp_rank: int, pp: int, per_rank: int) -> list[LlamaStage]:
    """The rank's stages of ``model`` (blocks as :func:`stage_layers` shares them)."""
    num_stages = pp * per_rank
    layers = stage_layers(len(model.layers), num_stages)
    return [LlamaStage(model, layers[s], s == 0, s == num_stages - 1)
            for s in stage_ids(pp_rank, pp, per_rank)]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _io(cfg, stage: int, num_stages: int, rows: int, seq: int, hidden_seq: int, device,
        act_dtype):
    """Example input and output of a stage, for PipelineStage (shapes and dtypes only): the
    rank's tokens (``seq``: cut by cp) in and logits out at the ends, hidden states between
    (``hidden_seq``: cut by tp's sequence parallel too)."""
    # requires_grad: a stage's input gradient goes back to the stage before it
    hidden = torch.empty(rows, hidden_seq, cfg.d_model, dtype=act_dtype, device=device,
                         requires_grad=True)
    inp = torch.empty(rows, seq, dtype=torch.long, device=device) if stage == 0 else hidden
    out = torch.empty(rows, seq, cfg.vocab, dtype=torch.float32, device=device,
                      requires_grad=True) if stage == num_stages - 1 else hidden
    return inp, out


# micro-batches of a pipeline stage's warm-up (_warm_step): a first and a last backward
WARM_MICRO_BATCHES = 2
_SCHEDULES = {PipelineSchedule.gpipe: "ScheduleGPipe", PipelineSchedule.f1b1: "Schedule1F1B",
              PipelineSchedule.interleaved_1f1b: "ScheduleInterleaved1F1B"}


def _static_warmup(stages, has_backward: bool, p2p_done: bool) -> None:
    """The schedule's first-step vote on fake: every stage was given its shapes, so each
    votes static, as they would on a real device; the vote itself reads a received tensor's
    value (``.item()``), which a fake one has not."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        assert not InferenceMode.needs_dynamic(stage._user_meta, has_backward)
        stage._inference_mode = InferenceMode.STATIC


def pipeline_step(stages: list[LlamaStage], cfg, device: torch.device, pp_mesh, fsdp_mesh,
                  act_dtype: torch.dtype, seq: int, hidden_seq: int, fake: bool):
    """FSDP2 on each stage, the schedule and AdamW; ``step(batch)``: one schedule step per
    grad-accumulation micro-batch (each ``pp_microbatches`` x ``batch_size`` samples)."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    par = cfg.parallelism
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * par.pp_stages_per_rank
    n_mb = par.pp_microbatches or pp

    # default: no resharding (the micro-batches' forwards would all-gather again)
    kwargs = {"mesh": fsdp_mesh, "reshard_after_forward": reshards_after_forward(cfg, 0, 1, True),
              **offload_kwargs(cfg, device)}
    if cfg.precision == "bf16_mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    pipes = []
    for index, stage in zip(stage_ids(pp_rank, pp, par.pp_stages_per_rank), stages):
        if fsdp_mesh is not None:  # None: no dp_shard x cp ranks, no FSDP (as torchtitan)
            for block in stage.layers.values():
                fully_shard(block, **kwargs)
            fully_shard(stage, **kwargs)
        inp, out = _io(cfg, index, num_stages, cfg.batch_size, seq, hidden_seq, device,
                       act_dtype)
        pipes.append(pipelining.PipelineStage(stage, index, num_stages, device, input_args=inp,
                                              output_args=out, group=pp_mesh.get_group()))
    schedule_class = getattr(pipelining, _SCHEDULES[par.pp_schedule])
    one = par.pp_schedule != PipelineSchedule.interleaved_1f1b
    schedule = schedule_class(pipes[0] if one else pipes, n_mb, loss_fn=_loss)
    if fake:
        schedule._warmup_p2p = _static_warmup
    params = [p for stage in stages for p in stage.parameters()]
    opt = make_optimizer(cfg, params)
    first, last = stage_ids(pp_rank, pp, par.pp_stages_per_rank)[0] == 0, \
        num_stages - 1 in stage_ids(pp_rank, pp, par.pp_stages_per_rank)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        for idx, targets in batch:
            args = (idx,) if first else ()
            schedule.step(*args, target=targets if last else None, losses=[] if last else None)
        opt.step()

    step.optimizer = opt
    if one and n_mb > WARM_MICRO_BATCHES:
        step.warm_step = _warm_step(pipes[0], schedule, opt, params, n_mb, cfg.batch_size, fake)
    return step


def _warm_step(pipe, schedule, opt, params, n_mb: int, rows: int, fake: bool):
    """A warm-up iteration of WARM_MICRO_BATCHES micro-batches (``rows`` samples each) through
    ``pipe``'s stage in a GPipe of its own, that leaves what ``schedule``'s full iteration
    leaves for the next at a fraction of its cost (a 405B stage's warm-up was a third of its
    capture: 32 micro-batches of 16 blocks):

    * every parameter's optimizer state, FSDP2's lazy init and each block's unsharded
      parameters made once;
    * the first-time work of each op DTensor sees (its sharding propagation, recorded if it
      came in the recorded iteration): a first and a last backward, the accumulation between
      them, the gradients scaled by ``n_mb`` as the schedule scales them;
    * ``schedule``'s own first-step set-up: its micro-batches' receive buffers, held from then
      on. It drops the gradients (metadata inference's cleanup), which a full iteration leaves
      until the next one's ``zero_grad``: they are given back;
    * on the last stage, ``n_mb`` kept outputs (the schedule holds every micro-batch's logits
      until the next step begins).

    ``tests/capture/test_pipeline_warm_step.py`` checks the recorded iteration is, op for op,
    the one a full warm-up leaves."""
    from torch.distributed.pipelining import ScheduleGPipe

    warm = ScheduleGPipe(pipe, WARM_MICRO_BATCHES, loss_fn=_loss, scale_grads=False)
    if fake:
        warm._warmup_p2p = _static_warmup
    num = WARM_MICRO_BATCHES * rows

    def warm_step(batch):
        (idx, targets), = batch  # grad_accum_steps is 1 under pp (validate_parallelism)
        first, last = pipe.is_first, pipe.is_last
        opt.zero_grad(set_to_none=True)
        warm.step(*((idx[:num],) if first else ()), target=targets[:num] if last else None,
                  losses=[] if last else None)
        pipe.scale_grads(n_mb)
        opt.step()
        grads = [p.grad for p in params]
        args, kwargs = schedule._split_inputs((idx,) if first else ())
        schedule._initialize_stage(args[0], kwargs[0], targets[:rows] if last else None)
        for p, grad in zip(params, grads):
            p.grad = grad
        kept = pipe.output_chunks
        if last and kept:
            kept += [torch.empty_like(kept[-1]) for _ in range(n_mb - len(kept))]

    return warm_step
