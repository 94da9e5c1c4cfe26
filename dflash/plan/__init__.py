"""Memory and cost planning of a training run, a user feature (`python -m dflash.plan`, DESIGN §1): the per-GPU
peak of a step (memory.py, which training also reads to refuse a step that does not fit and to choose gradient
checkpointing), model FLOPs (flops.py), the feature cache, host memory, GPU-hours and the set-up to train with
(costs.py), the real targets' dimensions (targets.py), the plan of a configured run in words (report.py), and what a
drafter buys at a concurrency when served (serving.py: `python -m dflash.plan ... concurrency=[1,8,32] tau=...`)."""

from dflash.plan.compose import compose
from dflash.plan.configured import (active_intermediate, checkpointing_of, moe_experts, setup_of, shape_of,
                                    sliding_window)
from dflash.plan.memory import (BACKWARD, BUILD_BYTES, DENSE_MASK_BYTES, MODES, PERSISTENT, GiB, Setup, Shape,
                                block_mask_bytes, breakdown, choose_checkpointing, flex_padded, layer_activations,
                                max_anchors, mode_name, peak, phases, sdpa_mask_bytes, selective_outputs, state_terms,
                                terms)
from dflash.plan.report import PLAN_KEYS, active_params, build, drafter_shape, main, make_plan, make_run, render
from dflash.plan.targets import TARGETS, target_config

__all__ = ["BACKWARD", "BUILD_BYTES", "DENSE_MASK_BYTES", "MODES", "PERSISTENT", "PLAN_KEYS", "TARGETS", "GiB",
           "Setup", "Shape", "active_intermediate", "active_params", "block_mask_bytes", "breakdown", "build",
           "checkpointing_of", "choose_checkpointing", "compose", "drafter_shape", "flex_padded", "layer_activations",
           "main", "make_plan", "make_run", "max_anchors", "mode_name", "moe_experts", "peak", "phases", "render",
           "sdpa_mask_bytes", "selective_outputs", "setup_of", "shape_of", "sliding_window", "state_terms",
           "target_config", "terms"]
