"""ort_optim's bridges to the engines that run it: torch.distributed (DTensor/FSDP2/tensor parallel, DDP and plain
process groups, distributed checkpoints) in :mod:`ort_optim.integrations.dtensor`; DistributedDataParallel seen from
step_in_backward in :mod:`ort_optim.integrations.ddp`.

Nothing here shards, launches or communicates on its own account: the engines (FSDP2, DTensor, DDP, DCP,
DeepSpeed) do that. These modules only tell the optimizer what a parameter's local piece is, how to count it in a
global decision, and how to hand its state back in the engine's own form.

DeepSpeed: :mod:`ort_optim.integrations.deepspeed` (the ZeRO overflow-check and gradient-norm patch that
FP16_Optimizer applies, and which DeepSpeed object holds an optimizer).
"""
