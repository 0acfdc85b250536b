"""Resource plan: how many engine actors, what each holds, and how they pack onto nodes.

Pure arithmetic over `AppConfig`; printed by `--dry-run` and used to set each actor's
Ray resources, so the plan shown is the plan run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from configs.schema import AppConfig


@dataclass(frozen=True)
class ResourcePlan:
    device: str
    min_actors: int
    max_actors: int
    cpus_per_actor: float
    gpus_per_actor: int
    tensor_parallel_size: int
    accelerator_type: str | None
    actors_per_node: int | None
    nodes_for_max_actors: int | None

    def ray_actor_options(self) -> dict[str, Any]:
        """Resources one engine actor requests from Ray."""
        opts: dict[str, Any] = {"num_cpus": self.cpus_per_actor, "num_gpus": self.gpus_per_actor}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        per = (
            f"{self.gpus_per_actor} GPU (TP={self.tensor_parallel_size}) + {self.cpus_per_actor:g} CPU"
            if self.device == "gpu"
            else f"{self.cpus_per_actor:g} CPU"
        )
        line = f"{self.min_actors}..{self.max_actors} actors x [{per}]"
        if self.actors_per_node is not None:
            line += (
                f"; {self.actors_per_node} actors per {self.accelerator_type or 'GPU'} node, "
                f"{self.nodes_for_max_actors} node(s) at max"
            )
        return line


def resource_plan(cfg: AppConfig) -> ResourcePlan:
    pool, tp = cfg.pool, cfg.engine.tensor_parallel_size
    gpus = tp if pool.device == "gpu" else 0
    per_node = pool.gpus_per_node // gpus if gpus and pool.gpus_per_node else None
    return ResourcePlan(
        device=pool.device,
        min_actors=pool.min_actors,
        max_actors=pool.max_actors,
        cpus_per_actor=pool.cpus_per_actor,
        gpus_per_actor=gpus,
        tensor_parallel_size=tp,
        accelerator_type=pool.accelerator_type,
        actors_per_node=per_node,
        nodes_for_max_actors=math.ceil(pool.max_actors / per_node) if per_node else None,
    )
