"""One ``torch.distributed`` call per collective kind: the table the collective replay issues
through, with what gloo needs around it (all_to_all with unequal list entries)."""
from __future__ import annotations

import torch
import torch.distributed as dist

AG_ONE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
RS_ONE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Ctx:
    """What a call needs besides its buffers: group, reduce op, root (global), device."""

    __slots__ = ("pg", "red", "root", "is_root", "device")

    def __init__(self, pg, red, root, is_root, device):
        self.pg, self.red, self.root, self.is_root, self.device = pg, red, root, is_root, device


# kind -> call(ctx, ins, outs, async_op) -> Work | None; roots and peers are global ranks.
CALLS = {
    "all_reduce": lambda x, i, o, a: dist.all_reduce(o[0], op=x.red, group=x.pg, async_op=a),
    "all_gather": lambda x, i, o, a: dist.all_gather(o, i[0], group=x.pg, async_op=a),
    "all_gather_into_tensor": lambda x, i, o, a: AG_ONE(o[0], i[0], group=x.pg, async_op=a),
    "reduce_scatter": lambda x, i, o, a: dist.reduce_scatter(o[0], i, op=x.red, group=x.pg,
                                                             async_op=a),
    "reduce_scatter_tensor": lambda x, i, o, a: RS_ONE(o[0], i[0], op=x.red, group=x.pg,
                                                        async_op=a),
    "broadcast": lambda x, i, o, a: dist.broadcast(o[0], src=x.root, group=x.pg, async_op=a),
    "reduce": lambda x, i, o, a: dist.reduce(o[0], dst=x.root, op=x.red, group=x.pg, async_op=a),
    "gather": lambda x, i, o, a: dist.gather(i[0], o if x.is_root else None, dst=x.root,
                                             group=x.pg, async_op=a),
    "scatter": lambda x, i, o, a: dist.scatter(o[0], i if x.is_root else None, src=x.root,
                                               group=x.pg, async_op=a),
    "barrier": lambda x, i, o, a: dist.barrier(group=x.pg, async_op=a, device_ids=(
        [x.device.index or 0] if x.device.type == "cuda" else None)),
    "send": lambda x, i, o, a: (dist.isend if a else dist.send)(o[0], dst=x.root, group=x.pg),
    "recv": lambda x, i, o, a: (dist.irecv if a else dist.recv)(o[0], src=x.root, group=x.pg),
}
# coalesced kind -> one part issued inside a coalescing manager: (out, in, reduce op, group)
COALESCED_PART = {
    "all_reduce_coalesced": lambda o, i, red, pg: dist.all_reduce(o, op=red, group=pg),
    "all_gather_into_tensor_coalesced": lambda o, i, red, pg: AG_ONE(o, i, group=pg),
    "reduce_scatter_tensor_coalesced": lambda o, i, red, pg: RS_ONE(o, i, op=red, group=pg),
}


def all_to_all_rows(c, in_t, out_t) -> bool:
    """True when the recorded splits count dim-0 rows of these very tensors."""
    return (in_t.dim() > 0 and out_t.dim() > 0 and sum(c.in_splits) == in_t.shape[0]
            and sum(c.out_splits) == out_t.shape[0])


def all_to_all_list(outs: list, ins: list, pg, async_op: bool):
    """all_to_all over lists; gloo rejects unequal entries, so those go through one packed
    all_to_all_single and are copied out when it completes."""
    sizes = {t.numel() for t in ins + outs}
    if len(sizes) <= 1:
        return dist.all_to_all(outs, ins, group=pg, async_op=async_op), None
    send = torch.cat([t.reshape(-1) for t in ins])
    recv = torch.empty(sum(t.numel() for t in outs), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, [t.numel() for t in outs],
                                  [t.numel() for t in ins], group=pg, async_op=async_op)

    def finish():
        for dst, src in zip(outs, recv.split([t.numel() for t in outs])):
            dst.copy_(src.view(dst.shape))
    return work, finish
