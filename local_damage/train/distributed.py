"""Data-parallel training with torch.distributed (launched by `torchrun`).

Contrastive terms need negatives from the whole global batch, not just a replica's share. Each
replica gathers every replica's embeddings and labels with
``torch.distributed.nn.functional.all_gather``, which carries gradients back to the replica that
produced them, and computes the contrastive loss over the global batch. Every replica thus
computes the same global loss; the backward all-gather sums its gradient over replicas (W times
the gradient of the local embeddings) and DDP's gradient averaging divides by W again, which
gives exactly the gradient of the global-batch loss. The cross-entropy term stays local and
DDP's averaging makes it the global mean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group when started by torchrun (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def gather_with_grad(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate ``x`` [b, ...] from every replica along dim 0, differentiably."""
    if not info.enabled:
        return x
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous()), dim=0)


def gather_labels(y: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate label tensors [b] from every replica (no gradient)."""
    if not info.enabled:
        return y
    out = [torch.empty_like(y) for _ in range(info.world_size)]
    dist.all_gather(out, y.contiguous())
    return torch.cat(out, dim=0)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def replica_checksums(model: torch.nn.Module, info: DistInfo) -> list[float]:
    """The sum of every parameter of ``model`` on each replica (identical replicas agree)."""
    checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))])
    gathered = [torch.zeros(1, dtype=checksum.dtype) for _ in range(info.world_size)]
    dist.all_gather(gathered, checksum)
    return [float(g.item()) for g in gathered]
