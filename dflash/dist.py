"""The little of distributed state that data preparation needs: rank, world size, barrier."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> Dist:
    """This process's place in an `accelerate launch` (or a single process)."""
    import torch
    from accelerate import PartialState

    # cpu=True on machines without CUDA: otherwise accelerate does not start the gloo group
    # and every process of an `accelerate launch` believes it is alone
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes == 1:
        return Dist()
    return Dist(state.process_index, state.num_processes, state.wait_for_everyone)
