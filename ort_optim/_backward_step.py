"""FusedAdam's ``step_in_backward=True``: each parameter is updated by a post-accumulate-grad hook as soon as its
gradient is complete, and its gradient is freed, so the gradients of the whole model never exist at once.

The update of one parameter is the op's update of that tensor alone (the same kernel, the same per-tensor step count
and bias corrections, the same fp16 block scales), so the params come out bit for bit as from ``step()``. What needs
every gradient first cannot run here: FusedAdam refuses ``max_grad_norm`` with step_in_backward, and ``step()``
refuses ``grad_scale``/``found_inf`` (torch.amp.GradScaler). Gradient accumulation over several backward calls goes
through :meth:`BackwardStep.accumulate`: backward inside it only accumulates.

On the native CPU backend each parameter keeps a native plan of its own (ops/README.md, "AdamPlan"), valid while
its state tensors are the ones it was made for: a step through it costs about 10 us, against over 100 us for an op
call with nine one-tensor lists (torch 2.4.1, 2 cores).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from . import backends

if TYPE_CHECKING:
    from .fused_adam import FusedAdam

class BackwardStep:
    """The hooks of one FusedAdam(step_in_backward=True). They hold the optimizer weakly: once it is gone, they do
    nothing (gradients then accumulate as without it)."""

    def __init__(self, optimizer: "FusedAdam") -> None:
        self._optimizer = weakref.ref(optimizer)
        self._where: dict[torch.Tensor, tuple[int, int, dict]] = {}  # param -> (group index, index, group)
        self._handles: list = []
        self._plans: dict[torch.Tensor, tuple[tuple, Optional[backends.AdamPlan]]] = {}
        self._accumulating = 0

    def watch(self, group_index: int, group: dict) -> None:
        """Hooks the group's params that require gradients (a param made trainable later has no hook: step()
        updates it, like any param whose hook did not fire)."""
        for index, p in enumerate(group["params"]):
            self._where[p] = (group_index, index, group)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def forget_plans(self) -> None:
        """Drops the per-param plans (the optimizer replaced its states: load_state_dict)."""
        self._plans.clear()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward calls inside only accumulate gradients (the micro-batches before the last)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def _hook(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or self._accumulating:
            return
        with torch.no_grad():
            self._step(optimizer, p)
        p.grad = None

    def _step(self, optimizer: "FusedAdam", p: torch.Tensor) -> None:
        """The update of one param by its gradient: validated first, so a bad gradient raises (naming the param)
        with nothing written."""
        from .fused_adam import _check_hyperparameters, _describe

        group_index, index, group = self._where[p]
        _check_hyperparameters(group, f"param_groups[{group_index}]")
        grad = p.grad
        optimizer._check_grad(group_index, index, p, grad)
        state = optimizer.state[p]
        if group["amsgrad"] and state and "max_exp_avg_sq" not in state:
            raise ValueError(f"{_describe(group_index, index, p)}: amsgrad is on but this parameter's state has no max_exp_avg_sq (it was "
                             "created with amsgrad=False); load a checkpoint made with amsgrad=True")
        if not state:
            state.update(optimizer._init_state(p, group["amsgrad"]))
        lists = _state_lists(state, group["amsgrad"])
        hyper = optimizer._hyperparameters(group)
        try:
            if backends.runs_natively(p.device):
                self._plan(p, state, lists).step(**hyper)
            else:
                backends.adam_step_([p], [grad], *lists, state["step"].view(1), **hyper)
        except RuntimeError as error:  # the op's own checks (a param whose shape changed under its state, ...)
            raise ValueError(f"{_describe(group_index, index, p)}: {error}") from error

    def _plan(self, p: torch.Tensor, state: dict, lists: list) -> backends.AdamPlan:
        """p's native plan; rebuilt when the tensors of its state are not the ones it was made for (a step() that
        planned its bucket gives the states new step views; load_state_dict gives new states)."""
        key = (state["step"], *(t for tensors in lists for t in tensors))
        cached = self._plans.get(p)
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)):
            plan = backends.AdamPlan.create([p], *lists, state["step"].view(1))
            cached = self._plans[p] = (key, plan)
        return cached[1]


def _state_lists(state: dict, amsgrad: bool) -> list[list[torch.Tensor]]:
    """One param's state as the op's state lists (exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, then the
    three fp16 scale lists), each with one tensor or none."""

    def one(key: str, used: bool = True) -> list[torch.Tensor]:
        return [state[key]] if used and key in state else []

    return [one("exp_avg"), one("exp_avg_sq"), one("max_exp_avg_sq", amsgrad), one("master_param"),
            one("exp_avg_scale"), one("exp_avg_sq_scale"), one("max_exp_avg_sq_scale", amsgrad)]
