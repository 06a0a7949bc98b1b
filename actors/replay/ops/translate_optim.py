"""Fused optimizer kernels as their foreach form, for devices without a fused kernel.

torch 2.13 has CPU kernels for every ``_fused_{sgd,adam,adamw,adagrad}_`` overload; on meta,
``_fused_sgd_``, ``_fused_adagrad_`` and the ``tensor_lr`` overloads of Adam/AdamW have none.
Each function below takes the fused op's arguments and updates the same tensors in place with
``torch._foreach_*`` ops, following the CPU kernels: grads are unscaled in place by
``grad_scale``, ``maximize`` negates the gradient used (not the stored one), the step count is
read from ``state_steps`` (the optimizer increments it before the call), ``lr`` may be a float
or a 0-dim tensor, and a nonzero ``found_inf`` leaves every tensor unchanged.
"""
from __future__ import annotations

import torch

from actors.trace.model import Op
from actors.trace.op_schema import OpSchema


def _grads(grads, grad_scale, maximize):
    """The gradient the update uses: unscaled in place (like the fused kernels), negated for
    maximize into a new list."""
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)
    return torch._foreach_neg(grads) if maximize else grads


def _descend(params, update, lr) -> None:
    """params -= lr * update, for a float or a tensor lr."""
    if isinstance(lr, torch.Tensor):
        torch._foreach_sub_(params, torch._foreach_mul(update, lr))
    else:
        torch._foreach_add_(params, update, alpha=-lr)


def _unless_inf(found_inf, tensors, update) -> None:
    """Run ``update``; when ``found_inf`` is nonzero, restore ``tensors`` (no host sync)."""
    if found_inf is None:
        update()
        return
    saved = [t.clone() for t in tensors]
    update()
    skip = found_inf.ne(0)
    for t, s in zip(tensors, saved):
        t.copy_(torch.where(skip, s, t))


def sgd(op: Op, schema: OpSchema, device):
    def run(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
            nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
        params, bufs = self, momentum_buffer_list

        def update():
            g = _grads(grads, grad_scale, maximize)
            if weight_decay:
                g = torch._foreach_add(g, params, alpha=weight_decay)
            if momentum:
                if is_first_step:
                    torch._foreach_copy_(bufs, g)
                else:
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, g, alpha=1 - dampening)
                g = torch._foreach_add(g, bufs, alpha=momentum) if nesterov else bufs
            _descend(params, g, lr)
        _unless_inf(found_inf, [*params, *grads, *bufs], update)
    return run


def adam(decoupled: bool):
    """Adam (``decoupled`` False: weight decay added to the gradient) or AdamW (decoupled)."""
    def build(op: Op, schema: OpSchema, device):
        def run(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
                beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
            params = self

            def update():
                g = _grads(grads, grad_scale, maximize)
                if weight_decay and decoupled:
                    torch._foreach_mul_(params, 1 - lr * weight_decay)
                elif weight_decay:
                    g = torch._foreach_add(g, params, alpha=weight_decay)
                torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)
                # bias corrections from the step tensors, without reading them on the host
                neg_step_size = torch._foreach_pow(beta1, state_steps)  # beta1^t
                torch._foreach_sub_(neg_step_size, 1)
                torch._foreach_div_(neg_step_size, lr)
                torch._foreach_reciprocal_(neg_step_size)  # lr / (beta1^t - 1)
                bc2_sqrt = torch._foreach_pow(beta2, state_steps)
                torch._foreach_sub_(bc2_sqrt, 1)
                torch._foreach_neg_(bc2_sqrt)
                torch._foreach_sqrt_(bc2_sqrt)  # sqrt(1 - beta2^t)
                if amsgrad:
                    torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
                denom = torch._foreach_sqrt(max_exp_avg_sqs if amsgrad else exp_avg_sqs)
                torch._foreach_div_(denom, bc2_sqrt)
                torch._foreach_add_(denom, eps)
                torch._foreach_div_(denom, neg_step_size)
                torch._foreach_addcdiv_(params, exp_avgs, denom)
            _unless_inf(found_inf, [*params, *grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs],
                        update)
        return run
    return build


def adagrad(op: Op, schema: OpSchema, device):
    def run(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
            grad_scale=None, found_inf=None):
        params = self

        def update():
            g = _grads(grads, grad_scale, maximize)
            if weight_decay:
                g = torch._foreach_add(g, params, alpha=weight_decay)
            # clr = lr / (1 + (step - 1) * lr_decay), per parameter from its step tensor
            clr = torch._foreach_sub(state_steps, 1)
            torch._foreach_mul_(clr, lr_decay)
            torch._foreach_add_(clr, 1)
            torch._foreach_reciprocal_(clr)
            torch._foreach_mul_(clr, lr)
            torch._foreach_addcmul_(state_sums, g, g, 1)
            std = torch._foreach_sqrt(state_sums)
            torch._foreach_add_(std, eps)
            step = torch._foreach_div(g, std)
            torch._foreach_mul_(step, clr)
            torch._foreach_sub_(params, step)
        _unless_inf(found_inf, [*params, *grads, *state_sums], update)
    return run
