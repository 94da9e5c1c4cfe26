"""The provenance guard: features must come from the same target, tokenizer, layers, dtype and
kernels that a checkpoint was trained on.

One check, used by offline training, resume and evaluation. A drafter trained on
fla-computed states and evaluated on PyTorch-fallback states looks broken; this makes that
mistake loud instead of silent.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)

GUARDED_FIELDS = ("target", "tokenizer", "layer_ids", "dtype", "kernel_backend")
"""Manifest fields that must agree; each may be waived with provenance.allow_mismatch=[...]."""


class ProvenanceError(RuntimeError):
    """Features do not match what the checkpoint was trained on."""


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 300 else text[:297] + "..."


def check_provenance(expected: dict, actual: dict, allow: list[str] | tuple = (), *,
                     expected_name: str = "the checkpoint", actual_name: str = "the features",
                     fields: tuple = GUARDED_FIELDS) -> list[str]:
    """Compare the guarded fields of two manifests.

    Raises ProvenanceError naming every differing field that is not in `allow`, with both
    values and the override. Returns the allowed fields that differed (logged as warnings)
    so callers can record them. `fields` narrows the check to what `expected` knows.
    """
    differing = [f for f in fields if expected.get(f) != actual.get(f)]
    refused = [f for f in differing if f not in allow]
    if refused:
        lines = [f"  {f}: {_show(expected.get(f))} in {expected_name}, {_show(actual.get(f))} in {actual_name}"
                 for f in refused]
        raise ProvenanceError(
            f"{actual_name} do not match {expected_name}:\n" + "\n".join(lines) +
            f"\nRe-extract the features with the same target/kernels, or, if you know the difference is "
            f"harmless, override with provenance.allow_mismatch=[{','.join(refused)}]")
    for f in differing:
        log.warning("provenance: %s differs and is allowed by provenance.allow_mismatch: %s in %s, %s in %s",
                    f, _show(expected.get(f)), expected_name, _show(actual.get(f)), actual_name)
    return differing
