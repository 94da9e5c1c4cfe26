"""Peak host memory of loading a target, measured in a fresh process.

    python -m tests.target.load_probe FOLDER DEVICE DTYPE     # prints one JSON line

A thread samples /proc/self/status while `load_target` runs and keeps the peaks above what the process
held before: RssAnon, the process's own memory (where a load that fills the model on the host and moves it
after holds the model), and RssFile, pages of the memory-mapped weight files (the kernel's page cache: one
copy shared by every process that reads the same files, dropped under memory pressure). Linux only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MASK_TOKEN_ID = 5


def rss() -> dict[str, int]:
    """This process's resident memory in bytes: {"anon": RssAnon, "file": RssFile}."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key.removeprefix("Rss").lower()] = int(value.split()[0]) * 1024
    return fields


def write_target(folder: Path, hidden: int, layers: int, vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """A random-weight Qwen3 causal LM with the byte tokenizer saved in `folder`; returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.target.tokenizer import build_tokenizer

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def measure(folder: Path, device: str, dtype: str) -> dict:
    """Peak host memory (bytes above the baseline) of load_target(FOLDER) onto `device`, in a fresh process,
    and where the parameters ended up."""
    out = subprocess.run([sys.executable, "-m", "tests.target.load_probe", str(folder), device, dtype], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(folder: str, device: str, dtype: str) -> None:
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (imports are not the load)

    from dflash.config import TargetConfig
    from dflash.target.loading import load_target

    cfg = TargetConfig(name="probe", path=folder, mask_token_id=MASK_TOKEN_ID, dtype=dtype)
    if device.startswith("cuda"):
        torch.cuda.init()  # the CUDA context's host memory is not the load's
        torch.empty(1, device=device)
    base, peak, done = rss(), dict.fromkeys(("anon", "file"), 0), threading.Event()

    def sample() -> None:
        while not done.is_set():
            for key, value in rss().items():
                peak[key] = max(peak[key], value - base[key])
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        target = load_target(cfg, torch.device(device))
    finally:
        done.set()
        sampler.join()
    params = list(target.model.parameters())
    print(json.dumps({"peak_anon": peak["anon"], "peak_file": peak["file"],
                      "model_bytes": sum(p.numel() * p.element_size() for p in params),
                      "devices": sorted({str(t.device) for t in [*params, *target.model.buffers()]})}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
