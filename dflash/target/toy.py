"""The toy target: a small but real Qwen3.5 hybrid model (Gated DeltaNet + full attention)
pretrained on CPU on the Python standard library's source, with a byte-level BPE tokenizer
trained on the same text. Random-weight targets cannot show a drafter learning (their greedy
output is noise or a loop); this one writes plausible Python, so its drafts are learnable.

    python -m dflash.target.toy build [--out DIR] [--steps N] [--seed S]    # about 7 minutes on 2 cores

The corpus is every machine's own stdlib (no network). Files are split by a hash of their
relative path: `pretrain` (the model's training text), `validation` (its held-out loss) and
`prompts` (the default run's training prompts, never seen in pretraining). Examples are
chat-formatted: the user turn holds the first lines of a code chunk, the assistant continues it,
so the default run exercises the chat template and end-of-turn tokens like a real target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

from dflash.errors import NotFoundError
from dflash.io import write_json

log = logging.getLogger(__name__)

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip"}
VOCAB_SIZE = 2048
SEQ_LEN = 256
SHIPPED = Path(__file__).parents[1] / "assets" / "toy_target"


def corpus_files(split: str) -> list[Path]:
    """Stdlib sources of one split: pretrain (80%), validation (5%) or prompts (15%)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts):
            continue
        bucket = int(hashlib.sha256(rel.as_posix().encode()).hexdigest(), 16) % 20
        name = "validation" if bucket == 0 else "prompts" if bucket <= 3 else "pretrain"
        if name == split:
            out.append(p)
    return out


def code_chunks(files: list[Path], lines_per_chunk: int = 24) -> list[str]:
    """Non-trivial runs of consecutive lines (comments and docstrings included, as in the files)."""
    chunks = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for s in range(0, len(lines), lines_per_chunk):
            chunk = "\n".join(lines[s: s + lines_per_chunk]).strip("\n")
            if len(chunk) > 200:
                chunks.append(chunk)
    return chunks


def split_chunk(chunk: str, rng: random.Random) -> tuple[str, str]:
    """(prompt, continuation) at a line boundary in the first half."""
    lines = chunk.splitlines()
    cut = rng.randint(2, max(2, len(lines) // 2))
    return "\n".join(lines[:cut]), "\n".join(lines[cut:])


def chat_example(tokenizer, prompt: str, answer: str) -> str:
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return head + answer + "<|im_end|>\n"


EVAL_RESERVE = 64


def prompt_records(name: str = "stdlib", limit: int | None = None) -> list[dict]:
    """Prompts from the stdlib files held out of pretraining: the first lines of code chunks.

    `toy:stdlib` are training prompts; `toy:stdlib_eval` are the last EVAL_RESERVE chunks,
    never among the training prompts, for an in-domain held-out evaluation.
    """
    if name not in ("stdlib", "stdlib_eval"):
        raise NotFoundError(f"no toy prompt set {name!r}; use toy:stdlib or toy:stdlib_eval")
    rng = random.Random(0)
    chunks = code_chunks(corpus_files("prompts"))
    rng.shuffle(chunks)
    chunks = chunks[-EVAL_RESERVE:] if name == "stdlib_eval" else chunks[:-EVAL_RESERVE]
    records = []
    for i, chunk in enumerate(chunks[:limit]):
        prompt, _ = split_chunk(chunk, rng)
        records.append({"id": f"{name}-{i:05d}", "prompt": prompt})
    return records


def toy_config(vocab_size: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)


def pack_rows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate tokenized examples (separated by <|endoftext|>) and cut into rows."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False)["input_ids"] + [eot])
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def held_out_loss(model, rows: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, rows.shape[0], batch):
        x = rows[s: s + batch]
        total += model(x, labels=x).loss.item() * x.shape[0]
        count += x.shape[0]
    model.train()
    return total / max(count, 1)


def build_toy_target(dest: Path, steps: int = 440, seed: int = 0, batch: int = 16, lr: float = 4e-3) -> dict:
    """Tokenizer + pretraining + save_pretrained into `dest`; returns the build record."""
    from transformers import Qwen3_5ForCausalLM, get_cosine_schedule_with_warmup

    from dflash.target.tokenizer import build_tokenizer

    t0 = time.time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train_chunks = code_chunks(corpus_files("pretrain"))
    val_chunks = code_chunks(corpus_files("validation"))
    rng.shuffle(train_chunks)
    tokenizer = build_tokenizer(corpus=train_chunks[:6000], vocab_size=VOCAB_SIZE)
    log.info("toy tokenizer: %d tokens (%.0f s)", len(tokenizer), time.time() - t0)

    examples = [chat_example(tokenizer, *split_chunk(c, rng)) for c in train_chunks[: steps * batch * 2]]
    rows = pack_rows(tokenizer, examples, SEQ_LEN)
    val = pack_rows(tokenizer, [chat_example(tokenizer, *split_chunk(c, rng)) for c in val_chunks[:400]], SEQ_LEN)[:64]
    config = toy_config(len(tokenizer))
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = tokenizer.pad_token_id
    model = Qwen3_5ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps)
    model.train()
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        idx = order[(step * batch) % rows.shape[0]:][:batch]
        x = rows[idx]
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == steps - 1:
            log.info("toy pretraining step %d/%d loss %.3f (%.0f s)", step, steps, loss.item(), time.time() - t0)
    val_loss = held_out_loss(model, val)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest)  # bf16 on disk: small enough to ship (< 8 MB)
    tokenizer.save_pretrained(dest)
    record = {
        "held_out_loss": round(val_loss, 4), "held_out_tokens": int(val.numel()), "steps": steps, "batch": batch,
        "seq_len": SEQ_LEN, "train_tokens": steps * batch * SEQ_LEN, "seed": seed, "lr": lr,
        "params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
        "build_seconds": round(time.time() - t0, 1), "python": sys.version.split()[0], "torch": torch.__version__,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(dest / "toy_info.json", record)
    log.info("toy target built in %.0f s: held-out loss %.3f nats/token", record["build_seconds"], val_loss)
    return record


def install_shipped(dest: Path) -> bool:
    """Copy the checked-in toy target into `dest` (the fast path of `target=toy`)."""
    import shutil

    if not (SHIPPED / "config.json").exists():
        return False
    shutil.copytree(SHIPPED, dest, dirs_exist_ok=True)
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash.target.toy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenizer + pretraining from scratch (about 7 minutes on 2 cores)")
    b.add_argument("--out", type=Path, default=SHIPPED, help=f"output directory (default: {SHIPPED})")
    b.add_argument("--steps", type=int, default=440)
    b.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    record = build_toy_target(args.out, steps=args.steps, seed=args.seed)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
