"""Engine groups: the ranks that serve one tensor-parallel rollout engine together.

With `rollout.tensor_parallel_size = t`, ranks [g·t, (g+1)·t) form engine group g: one vLLM
engine sharded over their GPUs, which must all submit the same prompts with the same seed. The
policy, meanwhile, gives each rank its own prompts. So before generating, each group gathers its
members' prompts, every member generates all of them (identical results inside a group), and
each member keeps its own slice. Groups are consecutive ranks, so with torchrun's rank order they
are node-local whenever t divides the processes per node; `build` refuses any other layout, since
tensor parallel across nodes would put every decode step's all-reduces on the slow link.
With t = 1 every rank is its own group and nothing is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.distributed as dist

from rollout.base import Generation, PromptInput, SamplingParams


def check_layout(size: int, world: int, local_world: int) -> None:
    """Raise ValueError unless groups of `size` consecutive ranks tile the world and stay in a node."""
    if size < 1:
        raise ValueError(f"rollout.tensor_parallel_size={size} must be at least 1")
    if world % size:
        raise ValueError(f"rollout.tensor_parallel_size={size} does not divide the {world} ranks")
    if local_world % size:
        raise ValueError(f"rollout.tensor_parallel_size={size} does not divide the {local_world} processes per node: "
                         "an engine would span two nodes")


@dataclass
class EngineGroup:
    size: int = 1
    index: int = 0  # which group this rank is in
    member: int = 0  # this rank's place in its group
    group: object = field(default=None, repr=False)  # a gloo process group over the members (None when size 1)

    @classmethod
    def build(cls, size: int, world: int, rank: int, local_world: int) -> "EngineGroup":
        """Every rank must call this (creating process groups is collective)."""
        check_layout(size, world, local_world)
        if size == 1:
            return cls(1, rank, 0, None)
        groups = [dist.new_group(list(range(g * size, (g + 1) * size)), backend="gloo") for g in range(world // size)]
        return cls(size, rank // size, rank % size, groups[rank // size])

    def members(self) -> list[int]:
        return list(range(self.index * self.size, (self.index + 1) * self.size))

    def gather(self, prompts: list[PromptInput], params: SamplingParams) -> tuple[list[PromptInput], SamplingParams, int]:
        """The group's prompts in member order, the first member's sampling params (its seed for all),
        and where this member's prompts start."""
        if self.size == 1:
            return prompts, params, 0
        parts: list = [None] * self.size
        dist.all_gather_object(parts, (prompts, params), group=self.group)
        start = sum(len(p) for p, _ in parts[: self.member])
        return [x for p, _ in parts for x in p], replace(parts[0][1]), start

    @staticmethod
    def own(gens: list[Generation], start: int, count: int) -> list[Generation]:
        """This member's generations out of the group's, renumbered to its own prompts."""
        return [Generation(g.prompt_index - start, g.token_ids, g.logprobs, g.finish_reason, g.routed_experts)
                for g in gens if start <= g.prompt_index < start + count]
