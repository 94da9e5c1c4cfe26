"""Regenerates the tool conversations of tests/data/test_tools.py into a completions store, slowly, to be killed.

    python -m tests.data.tools_probe STORE    # DFLASH_HOME as the tests': tiny_qwen3_tools already built there

The target's answers are scripted (tests.data.test_tools.scripted), each batch of one taking 0.3 s, so a SIGKILL from
the test lands between stored answers or in the middle of one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def main(store: Path) -> None:
    from dflash.data import completions
    from dflash.target import load_target
    from tests.conftest import compose
    from tests.data.test_tools import prepare, resumable, scripted

    answer = scripted()

    def slow(*args):
        time.sleep(0.3)
        return answer(*args)

    completions.generate_hf = slow
    target = load_target(compose("train", ["target=tiny_qwen3_tools"]).target, torch.device("cpu"))
    prompts, kw = resumable()
    prepare(target, prompts, store, **kw)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
