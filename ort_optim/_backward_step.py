"""FusedAdam's ``step_in_backward=True``: each parameter is updated by a post-accumulate-grad hook as soon as its
gradient is complete, and its gradient is freed, so the gradients of the whole model never exist at once.

The update of one parameter is the op's update of that tensor alone (the same kernel, the same per-tensor step count
and bias corrections, the same fp16 block scales), so the params come out bit for bit as from ``step()``. What needs
every gradient first cannot run here: FusedAdam refuses ``max_grad_norm`` with step_in_backward, and ``step()``
refuses ``grad_scale``/``found_inf`` (torch.amp.GradScaler). Gradient accumulation over several backward calls goes
through :meth:`BackwardStep.accumulate`: backward inside it only accumulates. A hook in a backward nested in another
(reentrant activation checkpointing), where the gradient may be incomplete, refuses; each update bumps the autograd
version counters of what it wrote (the param, its states), as torch's in-place updates and step() do
(ort_optim/_versions.py); step() and zero_grad() connect again the hooks of params that torch.utils.swap_tensors gave
another tensor.

On the native CPU backend each parameter keeps a native plan of its own (ops/README.md, "AdamPlan"), used while its
check() passes and the optimizer's state has not changed (``optimizer.state.version``): a step through it costs
about 10 us, against over 100 us for an op call with nine one-tensor lists (torch 2.4.1, 2 cores). A group's
hyperparameters are validated and converted once while their values stay the same (a tensor lr: at every hook),
not at every hook: with those two, a hook costs about 30 us of Python and call overhead instead of about 60.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from typing import Iterator, Optional

import torch

from . import _heap, _plan, backends
from .integrations import deepspeed
from .integrations.ddp import ddp_reducing, ddp_refused


def _remove_handles(*handles: dict) -> None:
    """Removes the hooks of these dicts (param -> its hook's handle) and empties them."""
    for by_param in handles:
        for handle in by_param.values():
            handle.remove()
        by_param.clear()


# Every BackwardStep in the process, to find the other optimizers that update a param in backward (held weakly).
_EVERY: "weakref.WeakSet[BackwardStep]" = weakref.WeakSet()


class BackwardStep:
    """The hooks of one FusedAdam(step_in_backward=True) (given as ``optimizer``; ort_optim.fused_adam imports this
    module, not the other way). They hold this object, and through it the optimizer, weakly: once the optimizer is
    gone, this object goes with it and removes them (gradients then accumulate as without it)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        _EVERY.add(self)
        self._optimizer = weakref.ref(optimizer)
        self._where: dict[torch.Tensor, tuple[int, int, dict]] = {}  # param -> (group index, index, group)
        self._handles: dict[torch.Tensor, object] = {}  # param -> its hook's handle (one hook per param)
        self._impls: dict[torch.Tensor, int] = {}  # param -> its C++ tensor (p._cdata) when its hook was connected
        self._unhooked: dict[torch.Tensor, None] = {}  # params given without requires_grad (not hooked yet)
        # param -> ((optimizer.state.version, amsgrad, the group's rounding options, the backend choice, the layout
        # options), its runner on a native plan) when it was planned
        self._plans: dict[torch.Tensor, tuple[tuple, backends.PlanRunner]] = {}
        # (per param stepped without a native plan: its fingerprint at its last update, to tell new data)
        self._prints: dict[torch.Tensor, Optional[list]] = {}
        self._accumulating = 0
        self._updated: dict[torch.Tensor, None] = {}  # params updated by a hook since the last step()/zero_grad()
        self.setup_checked = False  # check_setup() passed (it runs once: before the first update, or at step())
        # param -> the handle of its setup hook (_setup_hook): a tensor hook that runs check_setup() before autograd
        # accumulates the param's first gradient, so that a refused setup leaves the gradients untouched too. Removed
        # once the check passed (at the end of that backward, or by step()/zero_grad()).
        self._setup_handles: dict[torch.Tensor, object] = {}
        # The autograd graph task whose end-of-backward check is queued (see _hook), None when none is: an id, not a
        # flag, because a backward that raises never runs its callbacks, and the next backward must queue its own.
        self._check_queued: Optional[int] = None
        self._task: tuple[Optional[int], bool] = (None, False)  # (the last hook's graph task, whether it is nested)
        # The checks across params (_plan.check_across_params) passed for this state version and these params lists'
        # versions (_checked_epoch), and in this backward (_checked_task), see _check_across_params.
        self._checked_epoch: Optional[tuple] = None
        self._checked_task: Optional[int] = None
        self._listed_epoch: Optional[tuple] = None  # (_forget_removed: the epoch whose params it last compared)
        # Once check_updated_once() found a param updated with another gradient, every later hook, step() and
        # zero_grad() raises the same error while such a gradient is there (cleared by hand, the next step() or
        # zero_grad() goes on without it; remove_backward_hooks() ends it too): none may update a param again.
        self._refusal: Optional[str] = None
        self._refused: list[torch.Tensor] = []  # (the params whose gradient written after their update it is about)
        # TorchDynamo must not trace the hook: torch.compile of a function that calls backward() would compile the
        # hooks that the engine calls from it (measured before this wrapper, torch 2.4.1 and 2.13: an error out of
        # tracing, or another param's state looked up for a param). It runs eagerly, as autograd's engine calls it.
        # The hooks hold this object weakly: a param holds its hooks, and a hook holding the object that holds the
        # param is a cycle through autograd's C++ hook storage, which the garbage collector does not see (measured:
        # the model and every state stayed alive after `del optimizer, model`). When this object goes (with its
        # optimizer), its hooks are removed from the params.
        step = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            this = step()
            if this is not None:
                this._hook(p)

        self._eager_hook = torch._dynamo.disable(hook)
        weakref.finalize(self, _remove_handles, self._handles, self._setup_handles)
        self._freed = _heap.FreedMemory()  # gives the freed gradients' memory back (glibc's heap, ort_optim/_heap.py)

    def check_not_hooked_elsewhere(self, group_index: int, group: dict) -> None:
        """Refuses, naming the param, a param of this group that another live FusedAdam(step_in_backward=True) still
        updates in backward: its hook would run first and update the param with that optimizer's state and lr, and
        this optimizer's hook would then find the gradient taken and raise, after the other had changed the model
        (as far as the backward got). Checked by check_setup() (the first backward, before any gradient of this
        optimizer's params is accumulated: not at construction, where ``opt = FusedAdam(...)`` still holds the
        optimizer it replaces) and by add_param_group(). An optimizer deleted but kept alive by a reference cycle is
        collected first, once, as its hooks would otherwise still fire."""
        def holder(p: torch.Tensor) -> Optional["BackwardStep"]:
            for other in list(_EVERY):
                if other is not self and p in other._handles and other._optimizer() is not None:
                    return other
            return None

        collected = False
        for index, p in enumerate(group["params"]):
            if not p.requires_grad or holder(p) is None:
                continue
            if not collected:
                gc.collect()
                collected = True
                if holder(p) is None:
                    continue
            raise ValueError(
                f"{_plan.describe(group_index, index, p)} is updated in backward by another FusedAdam with "
                "step_in_backward=True, which is still alive: its hook would update the param with that optimizer's "
                "state and lr before this optimizer's, which would then find the gradient taken. Call "
                "remove_backward_hooks() on the optimizer you no longer use (or delete it, and whatever refers to "
                "it); nothing was changed")

    def watch(self, group_index: int, group: dict) -> None:
        """Hooks the group's params that require gradients (a param made trainable later is hooked by the next
        step() or zero_grad(), restore_hooks(); until then step() updates it, like any param whose hook did not
        fire)."""
        for index, p in enumerate(group["params"]):
            self._where[p] = (group_index, index, group)
            if p.requires_grad and p not in self._handles:
                self._connect(p)
                if not self.setup_checked:
                    self._setup_handles[p] = p.register_hook(self._setup_hook())
            elif not p.requires_grad:
                self._unhooked[p] = None

    def _setup_hook(self):
        """A tensor hook for a param (it runs before autograd accumulates the param's gradient): check_setup() before
        the first gradient of this optimizer's params is accumulated; then nothing, until it is removed."""
        step = weakref.ref(self)

        @torch.utils.hooks.unserializable_hook  # (torch.save of the model: not saved, without a warning)
        def setup_hook(grad: torch.Tensor) -> None:
            this = step()
            optimizer = this._optimizer() if this is not None else None
            if optimizer is not None and not this.setup_checked:
                this.check_setup(optimizer)

        return setup_hook

    def remove_setup_hooks(self) -> None:
        """Removes the setup hooks once check_setup() passed (never while backward runs them)."""
        if self.setup_checked and self._setup_handles:
            for handle in self._setup_handles.values():
                handle.remove()
            self._setup_handles.clear()

    def restore_hooks(self) -> None:
        """Connects the hooks again of params whose tensor was swapped under them. torch.utils.swap_tensors
        (``model.to()`` with torch.__future__.set_swap_module_params_on_conversion(True)) gives the param object
        another C++ tensor; the hooks are kept in the old one's autograd metadata, so none fires any more (the
        param's dict of hooks stays on the Python object, disconnected), and a backward would silently leave the
        gradients to step(). Setting that dict again connects it: this optimizer's hook and any other. Hooks too the
        params given to this optimizer that did not require gradients then and do now. Runs in step() and
        zero_grad(): backward calls after such a conversion or change, before either, do not update those params.
        (Only params this optimizer was given, as watch() saw them: tensors put in param_groups by hand or by a
        wrapper are not hooked, see _check_not_repointed.) First removes the setup hooks, once check_setup() passed."""
        self.remove_setup_hooks()
        self._forget_removed()
        for p in [p for p in self._unhooked if p.requires_grad]:
            del self._unhooked[p]
            if p not in self._handles:
                self._connect(p)
        for p, impl in self._impls.items():
            if p._cdata == impl:
                continue
            hooks = p._post_accumulate_grad_hooks
            if hooks is None or self._handles[p].id not in hooks:
                self._handles[p] = p.register_post_accumulate_grad_hook(self._eager_hook)
            p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
            self._impls[p] = p._cdata

    def _forget_removed(self) -> None:
        """Forgets the params no longer in any param group (their group removed, or they from its list), once per
        change of the params lists or the state: their hooks are removed and nothing here refers to them, so they are
        freed with their group, as torch.optim's are (a loop that adds a group and removes it again grew by every
        param otherwise). Put back into param_groups by hand, such a param is one added by hand: step() updates it
        (add_param_group hooks it again). A param removed but not yet forgotten is not updated by its hook
        (_locate)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        epoch = self._epoch(optimizer)
        if epoch == self._listed_epoch:
            return
        optimizer._checked_groups.forget_removed(optimizer.param_groups)
        listed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for p in [p for p in self._where if id(p) not in listed]:
            for by_param in (self._handles, self._setup_handles):
                handle = by_param.pop(p, None)
                if handle is not None:
                    handle.remove()
            for by_param in (self._where, self._impls, self._unhooked, self._plans, self._prints, self._updated):
                by_param.pop(p, None)
        self._listed_epoch = epoch

    def _connect(self, p: torch.Tensor) -> None:
        """Registers this optimizer's hook on p, connected to p's C++ tensor. register_post_accumulate_grad_hook adds
        the hook to the param's dict of hooks and connects that dict to autograd only when it makes it: a param
        swapped by torch.utils.swap_tensors after it had a hook (an earlier optimizer's, the user's) keeps a dict
        that its new tensor does not know, and a hook added there would never fire (measured, torch 2.4.1 and 2.13),
        nor would restore_hooks() see a change to mend, as the param's tensor is the one it was hooked on. Setting the
        dict again connects it, with the hooks it already holds, as restore_hooks() does."""
        self._handles[p] = p.register_post_accumulate_grad_hook(self._eager_hook)
        p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
        self._impls[p] = p._cdata

    def remove(self) -> None:
        """Removes every hook: backward then only accumulates gradients."""
        _remove_handles(self._handles, self._setup_handles)
        self._impls.clear()
        self._unhooked.clear()
        self._refusal, self._refused = None, []

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
        if optimizer is None:
            return
        if _compiled_autograd():  # (before anything: the refusal must find every tensor as it was)
            raise compiled_autograd_refused()
        if not self.setup_checked:
            self.check_setup(optimizer)
        if self._accumulating:  # (a gradient accumulated for the next update, not written after this one)
            self._updated.pop(p, None)
            return
        if not self._locate(optimizer, p):
            self._check_not_repointed(optimizer)
            return
        if self._refusal is not None:
            raise ValueError(self._refusal)
        if optimizer.max_grad_norm is not None:  # (set after construction, which refuses it)
            raise max_grad_norm_refused(optimizer.max_grad_norm)
        # torch.amp.GradScaler hands these to step() as attributes, and leaves them there when step() refuses them:
        # a loop that caught that error would go on updating with scaled gradients here.
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            raise loss_scaling_refused()
        if p.grad is None:  # (autograd calls this hook with the gradient accumulated: another hook took it)
            group_index, index, _ = self._where[p]
            raise ValueError(
                f"{_plan.describe(group_index, index, p)}: its gradient was taken (set to None) by another "
                "post-accumulate-grad hook before this optimizer's, such as that of another FusedAdam with "
                "step_in_backward=True over the same param. Call remove_backward_hooks() on the optimizer you no "
                "longer use (or delete it, and whatever refers to it)")
        task = torch._C._current_graph_task_id()  # (-1 outside backward: a hook called by hand)
        seen = self._task
        if task != seen[0]:  # (whether a backward is nested does not change while it runs: looked up once)
            seen = self._task = (task, _in_nested_backward())
        if seen[1]:
            group_index, index, _ = self._where[p]
            raise ValueError(
                f"{_plan.describe(group_index, index, p)}: its gradient was accumulated by a backward run inside a "
                "node of another backward (torch.utils.checkpoint(..., use_reentrant=True) runs one per segment, as "
                "does any autograd Function whose backward calls backward), so the outer backward may still add to "
                "it: an update now could step the param twice, each time with part of its gradient. This param was "
                "not updated (params the outer backward completed before it were). Use "
                "torch.utils.checkpoint(..., use_reentrant=False), or step_in_backward=False")
        # (the step marks what it wrote as modified in place for autograd, as step() does: ort_optim/_versions.py)
        self._step(optimizer, p, task)
        self._freed.drop_grad(p)  # p.grad = None
        self._updated[p] = None
        if self._check_queued != task:
            self._queue_end_of_backward_check(task)

    def _queue_end_of_backward_check(self, task: int) -> None:
        """Queues check_updated_once() to run when this backward ends, after the callbacks queued during it
        (DistributedDataParallel queues the one that writes the averaged gradients back at its last bucket, after
        this first hook): so a loop that never calls step() or zero_grad() is refused too, at the end of the first
        backward, instead of updating with DDP's gradients accumulated into the next backward's. Re-queued once from
        the callback, because the engine runs callbacks in the order they were queued, including those queued while
        they run. Without autograd's engine (no backward running: a hook called by hand), step() and zero_grad()
        still check."""
        engine = torch.autograd.Variable._execution_engine

        def after_other_callbacks() -> None:
            self._check_queued = None
            self.remove_setup_hooks()
            self.check_updated_once(forget=False)

        try:
            engine.queue_callback(lambda: engine.queue_callback(after_other_callbacks))
        except RuntimeError:  # ("Final callbacks can only be installed during backward pass")
            return
        self._check_queued = task

    def check_setup(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuses what reduces the gradients across ranks after autograd has accumulated them, before anything
        changes: when the first backward is about to accumulate the first gradient of one of the optimizer's params
        (its setup hook), or at step() if that comes first. Runs once; only where torch.distributed is initialised
        (neither can exist without it), a heap scan each:

        * an optimizer that DeepSpeed holds (a DeepSpeedEngine's optimizer, or the inner optimizer of a ZeRO or
          DeepSpeed fp16/bf16 optimizer). DeepSpeed reduces the gradients after backward and, except at stage 0 in
          fp32, steps its own fp32 partitions or copies in place of the params: an update in backward would use this
          rank's unreduced gradient, or never happen while step() silently took a normal step
          (ort_optim/integrations/deepspeed.py, holder_of; only where DeepSpeed is imported);
        * params whose gradients a DistributedDataParallel reduces (:func:`ddp_reducing`): it writes the average
          into ``p.grad`` after autograd's accumulation, so an update in backward would use this rank's own gradient
          (and step() would update again with the average). The end-of-backward check (check_updated_once) stays as
          the backstop for a DistributedDataParallel made after this check ran.

        Everywhere, it also refuses a param that another live FusedAdam(step_in_backward=True) updates in backward
        (check_not_hooked_elsewhere)."""
        if self.setup_checked:
            return
        for group_index, group in enumerate(optimizer.param_groups):
            self.check_not_hooked_elsewhere(group_index, group)
        holder = deepspeed.holder_of(optimizer)
        if holder is not None:
            raise deepspeed_refused(holder)
        found = ddp_reducing(optimizer)
        if found is not None:
            raise ddp_refused(*found)
        self.setup_checked = True

    def _check_not_repointed(self, optimizer: torch.optim.Optimizer) -> None:
        """Called when a hooked param's gradient is complete but the param is no longer in param_groups. Removing
        params is fine (they keep their gradients, as with step()); but param_groups that hold a tensor this optimizer
        never hooked, or none of the params it hooked, were re-pointed, as mixed-precision and ZeRO wrappers do (flat
        fp32 partitions or fp32 copies whose gradients they set after backward; ZeRO stage 3 empties them between
        steps): no hook could update what they hold, and step() would silently take a normal step. Raises then,
        before any update."""
        def repointed(what: str) -> ValueError:
            return ValueError(
                f"{what}, while backward completes the gradient of a param it hooked that is no longer in "
                "param_groups: param_groups were re-pointed, as DeepSpeed's ZeRO and fp16/bf16 optimizers do (flat "
                "fp32 partitions or fp32 copies, whose gradients they set after backward). No update could run in "
                "backward, and step() would silently take a normal step. Use step_in_backward=False under such a "
                "wrapper; to give this optimizer params of your own, use add_param_group(), which hooks them")

        any_hooked = False
        for group_index, group in enumerate(optimizer.param_groups):
            for index, q in enumerate(group["params"]):
                if q not in self._where:
                    raise repointed(f"{_plan.describe(group_index, index, q)} is a tensor that step_in_backward=True "
                                    "never hooked")
                any_hooked = True
        if not any_hooked:
            raise repointed("param_groups hold none of the params that step_in_backward=True hooked")

    @property
    def updated_any(self) -> bool:
        """Whether a hook updated a param since the last step() or zero_grad()."""
        return bool(self._updated)

    def check_updated_once(self, forget: bool = True) -> None:
        """Raises if a param updated by its hook since the last step() or zero_grad() has a gradient again: something
        wrote one after autograd's accumulation, and step() would update the param a second time with it. Code after
        backward may (a gradient set by hand, where the normal loop would have stepped once with it); so does
        DistributedDataParallel: it averages the gradients across ranks once autograd has accumulated them, and
        writes the average back into ``p.grad`` (so the hook updated the param with this rank's gradient alone).
        Runs at the end of every backward that updated a param (_queue_end_of_backward_check), which keeps the
        record of the updated params (forget=False: a gradient written after this backward must still be found by
        step()), and in step() and zero_grad(), which clear it. A param removed from param_groups since its update is
        not concerned: neither its hook nor step() updates it again, so the gradients it accumulates or is given are
        its own, as for any tensor outside the optimizer."""
        if self._refusal is not None:
            # (refused until the gradients written after the update are gone: cleared by hand, the next step() or
            # zero_grad() goes on, without them; backward calls before that keep raising)
            if any(p.grad is not None for p in self._refused):
                raise ValueError(self._refusal)
            self._refusal, self._refused = None, []
        updated = self._updated
        if forget:
            self._updated = {}
        optimizer = self._optimizer()
        for p in updated:
            if p.grad is not None and (optimizer is None or self._locate(optimizer, p)):
                group_index, index, _ = self._where[p]
                self._refused = [q for q in updated
                                if q.grad is not None and (optimizer is None or self._locate(optimizer, q))]
                self._refusal = (
                    f"{_plan.describe(group_index, index, p)} was updated in backward by step_in_backward=True, and "
                    "has a gradient again: something wrote it after autograd's accumulation (code after backward, or "
                    "DistributedDataParallel, with the gradient averaged across ranks), so the update used another "
                    "gradient, and step() or the next backward would update it again with this one. Use "
                    "step_in_backward=False with DistributedDataParallel; to change a gradient, do it in a hook that "
                    "runs before the update (p.register_hook)")
                raise ValueError(self._refusal)

    def _locate(self, optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
        """Whether p is still one of the optimizer's params, keeping its (group index, index, group) current: a param
        removed from param_groups is not updated by its hook any more (it keeps its gradient), as step() would not
        update it; one moved within param_groups is found where it is now."""
        group_index, index, group = self._where[p]
        groups = optimizer.param_groups
        if group_index < len(groups) and groups[group_index] is group and index < len(group["params"]) \
                and group["params"][index] is p:
            return True
        for group_index, group in enumerate(groups):
            for index, q in enumerate(group["params"]):
                if q is p:
                    self._where[p] = (group_index, index, group)
                    self._plans.pop(p, None)  # (its rounding keys depend on its position)
                    return True
        return False

    def _check_across_params(self, optimizer: torch.optim.Optimizer, task: int, planning: bool) -> None:
        """The checks across params that step() makes when it plans (a param listed twice, params or state tensors
        sharing memory, one state dict for two params: _plan.check_across_params), which a hook, checking its own
        param, cannot make: run before an update whenever the state or a params list changed since they last passed
        (O(groups) to tell, at every hook), and before a param whose native plan's check failed is planned again
        (planning: its tensors changed, e.g. ``.data =``), once per backward. Raises before this hook's update
        (updates earlier in the same backward stay, as for any refusal in backward). Params stepped without a native
        plan (CUDA, the reference backend) are told by their fingerprint (_plan.fingerprints) at their last update."""
        if self._epoch(optimizer) == self._checked_epoch and not (
                planning and (task != self._checked_task or task < 0)):
            return
        _plan.check_across_params(optimizer.param_groups, optimizer.state, optimizer._layout)
        self._checked_epoch = self._epoch(optimizer)  # (the params lists may have become ParamLists just now)
        self._checked_task = task

    def release_plans(self) -> None:
        """Drops the per-param plans (the optimizer's state changed: each would be made again at its param's next
        update), with the state tensors they hold."""
        self._plans.clear()

    @staticmethod
    def _epoch(optimizer: torch.optim.Optimizer) -> tuple:
        """The optimizer's state version and its params lists' versions: what changes when the state or a params list
        does (_plan.new_version)."""
        return optimizer.state.version, [getattr(group["params"], "version", None) for group in optimizer.param_groups]

    def _step(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, task: int = -1) -> None:
        """The update of one param by its gradient, through a runner of that param alone (ort_optim.backends, as
        step() runs each bucket). Through the param's runner on a native plan while it is valid (its check() finds
        every tensor as it was and the gradient usable, and neither the optimizer's state nor the backend choice
        changed since); otherwise validated first as step() validates (a bad gradient raises naming the param, with
        nothing written), then planned again, or run through the op. The checks across params come first
        (_check_across_params)."""
        self._check_across_params(optimizer, task, planning=False)
        group_index, index, group = self._where[p]
        hyper = optimizer._checked_groups.of(group_index, group, optimizer._wide_options)
        amsgrad = bool(group["amsgrad"])
        # (the backend is chosen by ORT_OPTIM_BACKEND at every step: a plan made under another choice is not used;
        # nor one made before master_weights or a state dtype option changed, whose states step() would convert)
        rounding = _plan._rounding(group)
        # (stochastic rounding keys come from the param's position over all groups: params added to or removed from
        # an earlier group move it, with nothing here to notice but the position itself)
        position = sum(len(g["params"]) for g in optimizer.param_groups[:group_index]) + index if rounding[0] else None
        key = (optimizer.state.version, amsgrad, rounding, position, os.environ.get("ORT_OPTIM_BACKEND"),
               optimizer._layout)
        cached = self._plans.get(p)
        # (a new optimizer.state container has a version of its own: _plan.new_version)
        current = cached is not None and cached[0] == key and not torch.compiler.is_compiling()
        if current and cached[1].check():
            cached[1].step(hyper)  # (through the plan's pointers; it marks what it wrote)
            return
        # (a native plan's check failed, a native plan is out of date (options, backend), or a param stepped without
        # one has new data: `.data =`, `set_`)
        prints = None if current else _plan.fingerprints([p])
        if cached is not None or (p in self._prints and prints != self._prints[p]):
            self._check_across_params(optimizer, task, planning=True)
        self._plans.pop(p, None)  # (made again below where the param steps natively)
        with torch.no_grad():
            self._step_validated(optimizer, p, group_index, index, group, hyper, amsgrad, key)
        if p in self._plans:
            self._prints.pop(p, None)
        else:
            self._prints[p] = prints
        # (p's state, created or adopted just now, has memory of its own: the checks across params still hold)
        self._checked_epoch = self._epoch(optimizer)

    def _step_validated(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, group_index: int, index: int,
                        group: dict,
                        hyper: dict, amsgrad: bool, key: tuple) -> None:
        native = backends.runs_natively(p.device)
        state = self._validated_state(optimizer, p, group_index, index, amsgrad)
        lists = _state_lists(state, amsgrad)
        keys = _plan.rounding_keys(optimizer.param_groups, group_index, [index], p, "master_param" in state)
        try:
            if native:
                runner = backends.PlanRunner(backends.AdamPlan.create(
                    [p], *lists, state["step"].view(1), step_tensors=[state["step"]]), keys)
                if not runner.check():  # validated above: a plan that cannot step now is a bug, not a user error
                    raise RuntimeError("ort_optim: a per-param plan could not step right after it was built")
                self._plans[p] = (key, runner)
            else:  # (validated just now; the op marks what it writes, the step view included)
                runner = backends.OpRunner(lambda: [[p], [p.grad], *lists, state["step"].view(1)], lambda: True,
                                           p.device, keys)
            runner.step(hyper)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"{_plan.describe(group_index, index, p)}: {error}") from error

    @staticmethod
    def _validated_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, group_index: int, index: int,
                         amsgrad: bool) -> dict:
        """p's state, checked (and adopted into the optimizer's layout) as step() does, or created; raises naming the
        param before anything is written."""
        where = _plan.describe(group_index, index, p)
        problem = _plan._storage_problem(p)
        if problem is not None:
            raise ValueError(f"{where}: it {problem}")
        problem = _plan._grad_problem(p.grad, p)
        if problem is not None:
            raise _plan.GradientError(f"{where}: {problem}")
        state = optimizer.state[p]
        if not state:
            state.update(optimizer._layout.init_state(p, amsgrad))
            return state
        for adoption in _plan.check_state(optimizer._layout, p, state, amsgrad, where):
            if adoption.value is None:
                del adoption.state[adoption.key]
            else:
                adoption.state[adoption.key] = adoption.value
        return state


# The frame in which autograd runs the backward of a custom autograd Function (torch/autograd/function.py).
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def _in_nested_backward() -> bool:
    """Whether the running hook was called by a backward that runs inside a node of another backward: the backward
    of an autograd Function (torch.utils.checkpoint's reentrant variant recomputes its segment and runs backward over
    it there). The engine runs a nested backward on the thread of the node that started it, so the hook's Python
    frames then pass through that Function's backward; a top-level backward's pass through none (on CPU they lead
    back to the caller of backward, on an accelerator's engine thread to nothing)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


def _compiled_autograd() -> bool:
    """Whether the hook runs in a backward that compiled autograd runs (``torch._dynamo.compiled_autograd``, the
    ``torch._dynamo.config.compiled_autograd`` option), which replaces autograd's engine by a traced graph: the
    engine callback that checks the end of backward is not supported there, and the hooks' order and the gradients'
    lifetimes are the compiled graph's (measured before this refusal, torch 2.4.1 and 2.13: errors out of the graph
    after a param was updated and others' gradients were dropped). Refused rather than trusted without a test of
    every case step_in_backward covers. A model compiled with torch.compile alone is not this: autograd's engine
    still runs its backward and calls the hooks eagerly; neither is torch.compile of a function that calls backward()
    (the hooks are kept out of TorchDynamo's tracing: BackwardStep._eager_hook)."""
    if torch.compiler.is_compiling():
        return True
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "in_compiled_autograd_region", False)
                                       or getattr(module, "compiled_autograd_enabled", False))


def compiled_autograd_refused() -> ValueError:
    return ValueError(
        "FusedAdam(step_in_backward=True) does not update params in a backward run by compiled autograd "
        "(torch._dynamo.compiled_autograd, torch._dynamo.config.compiled_autograd=True): it replaces autograd's "
        "eager engine, whose order of hooks and end-of-backward callback the updates in backward rely on. Nothing was "
        "updated by this hook. Run backward without compiled autograd (torch.compile of the model, or of a function "
        "that calls backward(), is fine), or use step_in_backward=False")


def deepspeed_refused(holder: object) -> ValueError:
    return ValueError(
        f"FusedAdam(step_in_backward=True) is held by DeepSpeed's {type(holder).__name__} "
        f"({type(holder).__module__}). DeepSpeed reduces the gradients across ranks after backward (and, with ZeRO or "
        "its fp16/bf16 optimizers, steps its own flat fp32 partitions or copies in place of the params), so an update "
        "in backward would use this rank's unreduced gradient, or never run while step() silently took a normal step. "
        "Nothing was updated. Use step_in_backward=False with DeepSpeed: its own way to bound gradient memory is ZeRO "
        "stage 2/3 (each rank keeps only its partition of the gradients; overlap_comm reduces them during backward)")


def max_grad_norm_refused(max_grad_norm: float) -> ValueError:
    return ValueError(
        f"FusedAdam's max_grad_norm={max_grad_norm} clips by the norm of all gradients together, but "
        "step_in_backward=True updates each parameter as soon as its own gradient is complete, before the others "
        "exist, so no update can know that norm. To clip by it, use step_in_backward=False (step() clips inside "
        "the step). To keep step_in_backward, set max_grad_norm=None and bound each gradient before it accumulates "
        "with a tensor hook, param.register_hook(lambda g: g.clamp(-c, c)): a clip by value, element by element, "
        "not by the norm")


def loss_scaling_refused() -> ValueError:
    return ValueError(
        "grad_scale/found_inf (loss scaling, torch.amp.GradScaler) need every gradient before the first update, but "
        "step_in_backward=True updates each parameter during backward, as soon as its gradient is ready (here, or "
        "in the next backward outside accumulate()). Use step_in_backward=False with loss scaling (or bf16 autocast, "
        "which needs none)")


def _state_lists(state: dict, amsgrad: bool) -> list[list[torch.Tensor]]:
    """One param's state as the op's state lists (exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, then the
    three scale lists), each with one tensor or none."""

    def one(key: str, used: bool = True) -> list[torch.Tensor]:
        return [state[key]] if used and key in state else []

    return [one("exp_avg"), one("exp_avg_sq"), one("max_exp_avg_sq", amsgrad), one("master_param"),
            one("exp_avg_scale"), one("exp_avg_sq_scale"), one("max_exp_avg_sq_scale", amsgrad)]
