"""DistributedDataParallel and the updates made in backward: DDP averages each gradient across the ranks after autograd
has accumulated it and writes the average into ``p.grad``, so an update that runs as soon as autograd has accumulated
a param's gradient (FusedAdam's ``step_in_backward``) would use this rank's own gradient. This module finds a DDP that
reduces an optimizer's params, to refuse that setup before anything changes."""

from __future__ import annotations

import gc
import sys
from typing import Optional

import torch

from .._plan import describe


def ddp_reducing(optimizer: torch.optim.Optimizer) -> Optional[tuple[object, int, int, torch.Tensor]]:
    """(the DistributedDataParallel, group index, index, param) for the first of the optimizer's params whose gradient
    a torch.nn.parallel.DistributedDataParallel reduces (its ``_module_parameters``: the module's params that required
    gradients when it was made, less ``_ddp_params_and_buffers_to_ignore``; torch's composable ``replicate()`` keeps
    one too), or None. Answers None at once unless torch.distributed is initialised, which DDP needs; otherwise one
    pass over the garbage collector's objects, each told by its type (about 20-50 ms with torch loaded, 2 cores), so
    ask once, not per step."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ddp_type = getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None)
    if not isinstance(ddp_type, type):
        return None
    kinds, pending = set(), [ddp_type]
    while pending:  # DDP and its subclasses, so that each object costs a set lookup (an isinstance costs 3x that)
        kind = pending.pop()
        if kind not in kinds:
            kinds.add(kind)
            pending.extend(kind.__subclasses__())
    instances = [o for o in gc.get_objects() if type(o) in kinds]
    if not instances:
        return None
    where = {id(p): (group_index, index, p) for group_index, group in enumerate(optimizer.param_groups)
             for index, p in enumerate(group["params"])}
    for ddp in instances:
        reduced = getattr(ddp, "_module_parameters", None)
        if reduced is None:  # (a torch without it: the module's params less those DDP was told to ignore)
            ignored = getattr(ddp, "parameters_to_ignore", ())
            reduced = [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]
        for p in reduced:
            if id(p) in where:
                return (ddp, *where[id(p)])
    return None


def ddp_refused(ddp: object, group_index: int, index: int, p: torch.Tensor) -> ValueError:
    module = getattr(ddp, "module", None)
    return ValueError(
        f"{describe(group_index, index, p)} is reduced by {type(ddp).__name__} (torch.nn.parallel."
        f"DistributedDataParallel over a {type(module).__name__}): DDP averages each gradient across the ranks after "
        "autograd has accumulated it and writes the average into p.grad, so FusedAdam(step_in_backward=True) would "
        "update the param with this rank's own gradient, and step() again with the average. Nothing was updated (no "
        "gradient accumulated either). Use step_in_backward=False with DistributedDataParallel (its "
        "gradient_as_bucket_view=True keeps the gradients in DDP's buckets, without a second copy)")
