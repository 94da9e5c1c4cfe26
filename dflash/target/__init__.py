"""The target LLM: loading (or just its heads), identity (fingerprints, kernels), the one feature
function, the reference layer choice, and the built-in targets (tiny test models, the toy)."""

from dflash.target.features import TargetOutput, batched_features, target_forward
from dflash.target.layer_ids import build_target_layer_ids, resolve_layer_ids
from dflash.target.loading import Target, as_target, load_target

__all__ = ["Target", "TargetOutput", "as_target", "batched_features", "build_target_layer_ids", "load_target",
           "resolve_layer_ids", "target_forward"]
