"""Everything FusedAdam needs to know about DTensor params (FSDP2, tensor parallel, 2D meshes) and plain process
groups (DDP), as small functions without state.

* **Local pieces.** A DTensor param (``fully_shard``, ``parallelize_module``, ``distribute_tensor``) is stepped
  through its local tensor (:func:`local`); FusedAdam keeps its state as plain local tensors shaped like that piece.
  FSDP2 shards can be empty on some ranks (a dim 0 smaller than the world).
* **One global decision per step.** The gradient-clipping norm and the inf/NaN skip must be the same on every rank,
  computed over the whole model. Each rank sums the squares of its local gradient pieces, each piece weighted by
  ``1 / (number of ranks holding the same piece)`` (:func:`weight`: the product of the mesh sizes of the
  ``Replicate`` dims; a ``Shard`` dim splits, so counts once), adds an inf/NaN flag, and one ``all_reduce(SUM)`` of
  those two floats over the group that spans every rank (:func:`reduction_for`, :func:`all_reduce_stats`) gives
  every rank the global sum of squares and a flag that is non-zero when any rank saw inf/NaN (a SUM of
  non-negative flags is non-zero exactly when their MAX is). The result stays a device tensor: no host sync.
  Plain tensors with a ``process_group`` (DDP) are replicas: weight ``1 / group size``. Pipeline stages hold
  different params, so their sums are added as they are: a ``pipeline_group`` is one more all-reduce of the same
  two floats after the others (torchtitan's ``clip_grad_norm_(pp_mesh=...)`` does the same for the norm alone).
* **Checkpoints.** ``state_dict()`` hands each per-element state tensor back as a DTensor laid out like its param
  (:func:`wrap_like`), so ``torch.distributed.checkpoint`` saves and reshards it like the param itself;
  ``load_state_dict()`` takes the local piece again (:func:`local_like`), from a DTensor in any layout of the
  param's mesh, or from a full plain tensor (a one-process checkpoint). FusedAdam's saved form is already
  per-element and unscaled (no block scale spans shards), which is what makes this resharding exact.

* **Gradients laid out unlike their params.** Tensor parallelism leaves some gradients in another layout than their
  param: a ``Shard(0)`` embedding whose gradient is ``Replicate`` (``RowwiseParallel`` on an embedding), a
  ``Replicate`` norm weight whose gradient is ``Partial`` (``SequenceParallel``). torch's optimizers step them
  because DTensor redistributes the gradient to the param's placements; FusedAdam does the same, once per step, in
  the cheapest way (:func:`local_grad`): where the gradient is ``Replicate`` and the param ``Shard`` on the mesh
  dims that differ, this rank's piece is a slice of the gradient's local tensor (a view, no communication, no copy);
  otherwise ``DTensor.redistribute`` (a ``Partial`` gradient is reduced: all-reduce or reduce-scatter). Everything
  after that (the update, the norm, the skip) sees a gradient laid out like its param, so each element counts once in
  the global norm. A gradient on another mesh, of another global shape, or a plain tensor for a DTensor param (or the
  reverse) is refused (:func:`gradient_problem`). A ``Partial`` *param* is refused too (:func:`check_placements`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

try:  # torch >= 2.5: the public module; torch 2.4: the private one (same classes)
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - depends on the torch version
    try:
        from torch.distributed._tensor import DTensor, Replicate, Shard
    except ImportError:  # torch built without distributed support
        DTensor = Replicate = Shard = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor this rank stores for t: a DTensor's local piece (a view of its storage, so in-place updates land in
    the DTensor), t itself for a plain tensor, None for None."""
    if is_dtensor(t):
        # The DTensor's own local tensor, the same object at every call (the cached buckets compare identities):
        # to_local() returns a fresh view for an nn.Parameter(DTensor) in newer torch, and an autograd alias with grad
        # enabled.
        local_tensor = getattr(t, "_local_tensor", None)
        if isinstance(local_tensor, torch.Tensor):
            return local_tensor
        with torch.no_grad():
            return t.to_local()
    return t


def describe_layout(t: torch.Tensor) -> str:
    """A short description of how t is laid out over ranks, for error messages."""
    if not is_dtensor(t):
        return "a plain tensor"
    return f"a DTensor with placements {tuple(t.placements)} on {t.device_mesh}"


def _partial_problem(t: torch.Tensor) -> Optional[str]:
    if is_dtensor(t):
        for dim, placement in enumerate(t.placements):
            if placement.is_partial():
                return (f"is {describe_layout(t)}: mesh dim {dim} holds a partial sum, which FusedAdam cannot step or "
                        "count in the global norm; reduce it first (t.redistribute(t.device_mesh, [Replicate() or "
                        "Shard(d) per dim]))")
    return None


def check_placements(t: torch.Tensor, where: str) -> None:
    """Refuses Partial placements (an unreduced gradient) with a ValueError naming `where`."""
    problem = _partial_problem(t)
    if problem is not None:
        raise ValueError(f"{where} {problem}")


def gradient_problem(param: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    """Why grad cannot be brought to param's layout (:func:`local_grad`), as the end of an error message that starts
    with the param's name; None when it can (always for two plain tensors, and for a DTensor gradient of the param's
    global shape on the param's mesh, in any placements)."""
    if not (is_dtensor(param) or is_dtensor(grad)):
        return None
    if not (is_dtensor(param) and is_dtensor(grad)):
        return (f"the parameter is {describe_layout(param)} but its gradient is {describe_layout(grad)}; a DTensor "
                "param needs a DTensor gradient on its mesh, and a plain param a plain gradient")
    if grad.device_mesh != param.device_mesh:
        return (f"the parameter is {describe_layout(param)} but its gradient is {describe_layout(grad)}: a gradient "
                "on another device mesh")
    if tuple(grad.shape) != tuple(param.shape):
        return f"its gradient has the global shape {tuple(grad.shape)}, not the parameter's {tuple(param.shape)}"
    return None


def layout_problem(param: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    """Why grad cannot update param piece by piece as it is (a Partial gradient, or one laid out unlike its param, or
    any :func:`gradient_problem`), as the end of an error message that starts with the param's name; None when it
    can. For code that pairs local pieces without redistributing (FusedAdam redistributes: :func:`local_grad`)."""
    problem = gradient_problem(param, grad)
    if problem is not None or not is_dtensor(param):
        return problem
    problem = _partial_problem(grad)
    if problem is not None:
        return "its gradient " + problem
    if tuple(grad.placements) != tuple(param.placements):
        return (f"the parameter is {describe_layout(param)} but its gradient is {describe_layout(grad)}; they must "
                "be laid out alike")
    return None


def needs_redistribution(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether grad (a DTensor of param's mesh and shape, see :func:`gradient_problem`) is laid out unlike param."""
    return is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements)


def _sliced(param: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """grad's piece laid out like param's local tensor as a view of grad's local tensor (no communication), where
    on every mesh dim they differ grad is Replicate and param a plain Shard(d) of a tensor dim d that no other mesh
    dim shards (so the piece is one contiguous range of d: torch.chunk's, as DTensor's Shard); None elsewhere."""
    placements, piece = tuple(param.placements), local(grad)
    for mesh_dim, (want, have) in enumerate(zip(placements, grad.placements)):
        if want == have:
            continue
        if not (have.is_replicate() and type(want) is Shard
                and sum(isinstance(other, Shard) and other.dim == want.dim for other in placements) == 1):
            return None
        size, parts = piece.shape[want.dim], param.device_mesh.size(mesh_dim)
        chunk = -(-size // parts)
        start = min(chunk * param.device_mesh.get_local_rank(mesh_dim), size)
        piece = piece.narrow(want.dim, start, max(0, min(chunk, size - start)))
    return piece if piece.shape == local(param).shape else None


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of grad laid out like param's local tensor (grad as it is for plain tensors): the gradient's
    own local tensor when laid out alike; a slice of it where DTensor's Replicate -> Shard is a local slice
    (:func:`_sliced`: a view, no copy, no communication); else ``grad.redistribute`` to param's placements, a
    collective (every rank must take this step: FusedAdam does it for every param, in order, once per step)."""
    if not needs_redistribution(param, grad):
        return local(grad)
    piece = _sliced(param, grad)
    if piece is not None:
        return piece
    with torch.no_grad():
        return grad.redistribute(param.device_mesh, param.placements).to_local()


def replicas(t: torch.Tensor) -> int:
    """How many ranks of t's mesh hold each element of t (1 for plain tensors and fully sharded DTensors)."""
    if not is_dtensor(t):
        return 1
    mesh = t.device_mesh
    return math.prod(mesh.size(dim) for dim, placement in enumerate(t.placements) if placement.is_replicate())


@dataclass(frozen=True)
class Reduction:
    """Where a step's [sum of squares, inf flag] is all-reduced: over each of `groups` in turn (None: the default
    group), `size` ranks in all. One group except for a multi-dimensional mesh that does not span the world, whose
    dims are reduced one after the other (a sum over a grid is the sum of its rows' sums)."""

    groups: tuple
    size: int
    stages: tuple = ()  # then over each of these (pipeline stages: disjoint params, summed with weight 1)

    def spans(self, groups: Iterable[Any]) -> bool:
        """Whether a flag all-reduced here is all-reduced over each of ``groups`` (None: the default group) too:
        each is one of this reduction's groups (or has one rank), or this reduction runs over every rank."""
        import torch.distributed as dist

        own = self.groups + self.stages
        world = dist.get_world_size()
        if any(g is None or dist.get_world_size(g) == world for g in own):
            return True
        return all(g is not None and (dist.get_world_size(g) == 1 or any(g is o for o in own)) for g in groups)


def reduction_for(params: Iterable[torch.Tensor], process_group: Any = None,
                  pipeline_group: Any = None) -> Optional[Reduction]:
    """The reduction a step over these params needs; None when the decision is local (one process, or plain params
    without a process_group or pipeline_group).

    ``pipeline_group``: the ranks that hold the other pipeline stages of the same model replica; the stage's own
    reduction (below) runs first, then one all-reduce over it adds the stages' sums.

    With ``process_group`` given: that group. Otherwise, for DTensor params: the default group when their meshes
    span every rank (the usual FSDP2/TP/2D setup, one all-reduce), or the mesh's own group(s) when they all share one
    mesh over part of the ranks. Params on meshes with different ranks need an explicit ``process_group`` that spans
    them all (a ValueError says so).
    """
    import torch.distributed as dist

    within = _stage_reduction(params, process_group)
    if pipeline_group is None or dist.get_world_size(pipeline_group) == 1:
        return within
    return Reduction(within.groups if within else (), within.size if within else 1, (pipeline_group,))


def _stage_reduction(params: Iterable[torch.Tensor], process_group: Any) -> Optional[Reduction]:
    import torch.distributed as dist

    if process_group is not None:
        size = dist.get_world_size(process_group)
        return Reduction((process_group,), size) if size > 1 else None
    meshes = []
    for p in params:
        if is_dtensor(p) and not any(p.device_mesh is m for m in meshes):
            meshes.append(p.device_mesh)
    if not meshes or not (dist.is_available() and dist.is_initialized()):
        return None
    rank_sets = {frozenset(m.mesh.flatten().tolist()) for m in meshes}
    world = dist.get_world_size()
    if len(rank_sets) == 1:
        ranks = next(iter(rank_sets))
        if len(ranks) == 1:
            return None
        if len(ranks) == world:
            return Reduction((None,), world)
        mesh = meshes[0]
        return Reduction(tuple(mesh.get_group(dim) for dim in range(mesh.ndim)), len(ranks))
    if set().union(*rank_sets) == set(range(world)):
        return Reduction((None,), world)
    raise ValueError(
        f"FusedAdam: the params live on device meshes over different sets of ranks ({sorted(map(sorted, rank_sets))})"
        " that do not together span the default group; pass process_group= covering all of them, so that the "
        "gradient norm and the skip decision are global"
    )


def weight(t: torch.Tensor, reduction: Optional[Reduction]) -> float:
    """The factor for t's local sum of squares in the all-reduced sum: 1 / (ranks of the reduction holding the same
    elements). A DTensor counts once per distinct piece; a plain tensor is a replica on every rank of the reduction
    (DDP), unless there is no reduction."""
    if reduction is None:
        return 1.0
    if is_dtensor(t):
        return 1.0 / replicas(t)
    return 1.0 / reduction.size


def all_reduce_stats(stats: torch.Tensor, reduction: Optional[Reduction]) -> torch.Tensor:
    """Sums a float32 [sum of squares, inf/NaN flag] tensor over the reduction's ranks, in place, and returns it.

    One collective of two floats (per mesh dim only in the rare case described in :class:`Reduction`); a device
    tensor in and out, so no host sync (NCCL enqueues on the current stream; gloo runs on the CPU)."""
    if reduction is None:
        return stats
    import torch.distributed as dist

    for group in reduction.groups + reduction.stages:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return stats


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def wrap_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value (this rank's piece of a per-element state of param) as a DTensor laid out like param; value itself
    for a plain param. No communication; the DTensor shares value's storage."""
    if not is_dtensor(param):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=_contiguous_strides(param.shape))


def local_like(param: torch.Tensor, value: torch.Tensor, where: str) -> torch.Tensor:
    """This rank's piece, laid out like param's local tensor, of a checkpointed per-element state: a DTensor on
    param's mesh in any placements (redistributed when they differ), or a plain tensor of param's full shape (each
    rank takes its piece, without communication). For a plain param, a DTensor value is gathered whole. Raises a
    ValueError naming `where` when value cannot be laid out like param."""
    if not is_dtensor(param):
        return value.full_tensor() if is_dtensor(value) else value
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)} (its full shape; this rank "
            f"holds {tuple(local(param).shape)} of it as {describe_layout(param)})"
        )
    with torch.no_grad():
        if is_dtensor(value):
            if value.device_mesh != param.device_mesh:
                raise ValueError(
                    f"{where} is {describe_layout(value)}, the parameter {describe_layout(param)}: load it through "
                    "torch.distributed.checkpoint (set_optimizer_state_dict), which reshards onto the param's mesh"
                )
            if tuple(value.placements) != tuple(param.placements):
                value = value.redistribute(param.device_mesh, param.placements)
            return value.to_local()
        # a full tensor on every rank (a one-process checkpoint): Replicate -> param's placements slices locally
        replicated = DTensor.from_local(value.to(local(param).device), param.device_mesh,
                                        [Replicate()] * param.device_mesh.ndim, run_check=False)
        return replicated.redistribute(param.device_mesh, param.placements).to_local()
