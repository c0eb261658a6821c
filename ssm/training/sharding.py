"""``trainer.strategy: fsdp``: parameters, gradients and optimiser state sharded over the
processes (FSDP2, ``torch.distributed.fsdp.fully_shard``), through Lightning's
ModelParallelStrategy, which runs on the CPU with gloo as on GPUs with nccl (Lightning's own
FSDPStrategy refuses the CPU).

Every process is one data-parallel shard (tensor parallelism 1); each block of the backbone is
a unit of its own (its parameters gathered just before it runs and freed after), the rest (the
embedding, tied to the head, and the final norm) the root's. Gradients are averaged over all
processes, as DDP averages them, so that a run's losses are those of DDP with the same global
batch. It composes with ``trainer.context_parallel``: the ranks of a context-parallel group
read the same rows, and their loss is scaled so that this average is right (module.py).

Checkpoints are whole (``save_distributed_checkpoint=False``): Lightning gathers the full model
and optimiser state into one file, which resumes a run on the same number of processes and
loads into one process for generation; the run's model/ is written from the gathered weights."""

from __future__ import annotations

import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn


class FullyShardedStrategy(ModelParallelStrategy):
    """ModelParallelStrategy with every process a data-parallel shard and whole checkpoints."""

    strategy_name = "fsdp"

    def __init__(self, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_processes * self.num_nodes  # (the parent's "auto" is num_nodes)
        super().setup_environment()


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard(model: nn.Module, mesh) -> None:
    """fully_shard each block of ``model.backbone.layers``, then the whole model, over ``mesh``
    (its data-parallel dimension). Sharding a sharded model again does nothing."""
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return
    for block in model.backbone.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole state dict of a sharded ``model`` (on the CPU), gathered on every process (a
    collective: every process must call it); None for a model that is not sharded."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
