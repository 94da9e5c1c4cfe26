"""The toy target: a small but real Qwen3.5 hybrid model (Gated DeltaNet + full attention)
trained on CPU to rename a name in Python functions from the standard library, with a byte-level
BPE tokenizer trained on the same code. Random-weight targets cannot show a drafter learning (their
greedy output is noise or a loop), and a small model asked to write code of its own soon loops;
a rename is code that reads like the library, has one right answer, and ends its turn.

    python -m dflash.target.toy build [--out DIR] [--steps N] [--seed S] [--lr LR] [--init DIR]
                                      [--layers N] [--lookahead 2,3,4] [--lookahead-weight W]  # lookahead.py
    python -m dflash.target.toy measure [--dir DIR] [--write]    # held-out loss + sample continuations

A build from scratch (1200 steps of 16 x 512 tokens) takes about 70 minutes on 2 cores; `--init`
trains an earlier build further. The shipped build is not one from scratch: two stages that wrote
function bodies (the task before renames), two on renames, then two that grew it to 12 layers and
taught its layer 9 the tokens 2-4 ahead (docs/results/2026-12-02-toy-target.md lists the commands); how well a
from-scratch rename build does has not been measured. toy_info.json records how the shipped build
was made (nested `init` records for each earlier stage), its held-out loss and greedy continuations
of held-out renames: how often they end their turn, are the right answer, and repeat themselves.

The corpus is every machine's own stdlib (no network). Files are split by a hash of their
relative path: `pretrain` (the model's training text, tests included), `validation` (its held-out
loss and sample continuations) and `prompts` (the default run's training and held-out prompts,
never seen in pretraining; library code only). Every example is one function, chat-formatted
through the tokenizer's chat template: the user turn asks to rename one of its names
("Rename `value` to `size`:") and shows it, the assistant writes the renamed function and ends
with <|im_end|>. So the default run exercises the chat template, the response-only loss mask and
end-of-turn tokens as a real target does.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import logging
import random
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch

from dflash.errors import NotFoundError
from dflash.io import write_json
from dflash.target.lookahead import LookaheadHeads, deepen
from dflash.target.tokenizer import build_tokenizer, prompt_ids
from dflash.target.toy_measure import continuations, held_out_loss

log = logging.getLogger(__name__)

SKIP_DIRS = {"idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip"}
TEST_DIRS = {"test", "tests"}
VOCAB_SIZE = 2048
SEQ_LEN = 512
MAX_LINES, MAX_CHARS = 60, 700  # a function, its rename prompt and answer fit one SEQ_LEN row
EVAL_RESERVE = 64
SHIPPED = Path(__file__).parents[1] / "assets" / "toy_target"


def corpus_files(split: str, tests: bool = False) -> list[Path]:
    """Stdlib sources of one split: pretrain (80%), validation (5%) or prompts (15%) of the files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts) or (not tests and TEST_DIRS & set(rel.parts)):
            continue
        bucket = int(hashlib.sha256(rel.as_posix().encode()).hexdigest(), 16) % 20
        name = "validation" if bucket == 0 else "prompts" if bucket <= 3 else "pretrain"
        if name == split:
            out.append(p)
    return out


def functions(files: list[Path]) -> list[str]:
    """Every function and method of `files` (dedented, decorators included) that has a body to write
    after its docstring and is at most MAX_LINES lines / MAX_CHARS characters."""
    out = []
    for f in files:
        try:
            source = f.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            if node.end_lineno - start > MAX_LINES or len(node.body) < 1 + (ast.get_docstring(node) is not None):
                continue
            text = textwrap.dedent("\n".join(lines[start: node.end_lineno])).strip("\n")
            if 80 <= len(text) <= MAX_CHARS and "\t" not in text and _parses(text):
                out.append(text)
    return out


def _parses(text: str) -> bool:
    """False for a function that no longer parses on its own (a docstring line left of the def, once dedented)."""
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


def rename_names(node: ast.FunctionDef) -> list[str]:
    """The names a rename may pick in a parsed function: its arguments and the names it assigns, self and
    cls aside, each once, in order of appearance."""
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a]
    names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return [n for n in dict.fromkeys(names) if n not in ("self", "cls")]


def rename_task(text: str, rng: random.Random, pool: list[str],
                names: list[str] | None = None) -> tuple[str, str] | None:
    """(prompt, answer) of one rename: the user asks to rename one of the function's arguments or local
    names to a name from `pool` (never a word already in the function) and shows the function; the answer
    is the function with every occurrence of that name renamed (a whole word, not an attribute after a dot;
    docstring and strings included, as a plain search-and-replace does). None when it has no such name.
    `names`: the function's `rename_names`, when the caller has parsed it already."""
    names = rename_names(ast.parse(text).body[0]) if names is None else names
    words = set(re.findall(r"\w+", text))
    fresh = [n for n in pool if n not in words]
    if not names or not fresh:
        return None
    old, new = rng.choice(names), rng.choice(fresh)
    answer = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
    return f"Rename `{old}` to `{new}`:\n\n{text}", answer


def rename_examples(funcs: list[str], seed: int) -> list[tuple[str, str]]:
    """A rename (prompt, answer) for each function of `funcs` that has a name to rename; the new names
    are the argument names of `funcs`. Each function is parsed once."""
    rng = random.Random(seed)
    pool, names = set(), []
    for tree in map(ast.parse, funcs):
        pool.update(a.arg for a in ast.walk(tree) if isinstance(a, ast.arg))
        names.append(rename_names(tree.body[0]))
    pool = sorted(pool - {"self", "cls"})
    return [ex for f, n in zip(funcs, names) if (ex := rename_task(f, rng, pool, n)) is not None]


def chat_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one chat example as the pipeline makes it: the chat-templated prompt tokenized
    on its own, then the answer and <|im_end|> tokenized on their own, as the target generates them after it.
    (Tokenizing the joined text would merge the template's closing newlines with the answer's first token,
    a token the model then never sees at generation time, where the prompt ends.) The labels are the ids
    of the answer and -100 (no loss) on the prompt: the target learns to answer, as the drafter does."""
    head = prompt_ids(tokenizer, prompt)
    answer_ids = tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    return head + answer_ids, [-100] * len(head) + answer_ids


def prompt_records(name: str = "stdlib", limit: int | None = None) -> list[dict]:
    """Rename prompts on the library functions held out of pretraining.

    `toy:stdlib` are training prompts; `toy:stdlib_eval` are EVAL_RESERVE more, on functions never
    among the training prompts, for an in-domain held-out evaluation.
    """
    if name not in ("stdlib", "stdlib_eval"):
        raise NotFoundError(f"no toy prompt set {name!r}; use toy:stdlib or toy:stdlib_eval")
    prompts = _prompt_tasks()
    held_out = prompts[-EVAL_RESERVE:]
    chosen = held_out if name == "stdlib_eval" else prompts[:-EVAL_RESERVE]
    return [{"id": f"{name}-{i:05d}", "prompt": prompt} for i, prompt in enumerate(chosen[:limit])]


@functools.lru_cache(maxsize=1)
def _prompt_tasks() -> tuple[str, ...]:
    """The rename prompts of the prompt split's functions in a fixed shuffled order, each function once (a
    method written twice alike, `def __repr__(self): ...`, would be the same task). Parsing the files takes
    seconds and a run asks for both prompt sets (training, held-out) more than once: parsed once."""
    funcs = list(dict.fromkeys(functions(corpus_files("prompts"))))
    random.Random(0).shuffle(funcs)
    return tuple(prompt for prompt, _ in rename_examples(funcs, seed=0))


def toy_config(vocab_size: int, num_layers: int = 8):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)


def pack_rows(tokenizer, examples: list[tuple[list[int], list[int]]], seq_len: int) -> torch.Tensor:
    """Concatenate (ids, labels) examples, separated by <|endoftext|> (no loss), and cut into rows:
    a (rows, 2, seq_len) tensor of ids and labels."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    labels: list[int] = []
    for example_ids, example_labels in examples:
        ids.extend(example_ids + [eot])
        labels.extend(example_labels + [-100])
    n = len(ids) // seq_len
    return torch.tensor([ids[: n * seq_len], labels[: n * seq_len]]).view(2, n, seq_len).transpose(0, 1)


def pretraining_rows(tokenizer, funcs: list[str], rows: int, seed: int) -> tuple[torch.Tensor, float]:
    """`rows` rows of SEQ_LEN tokens from epochs of renames over `funcs` (each epoch shuffled, with new
    renames, and cut anew); and how many epochs."""
    rng = random.Random(seed)
    out, have = [], 0
    while have < rows:
        order = funcs[:]
        rng.shuffle(order)
        examples = rename_examples(order, seed=rng.randrange(2**32))
        epoch = pack_rows(tokenizer, [chat_example(tokenizer, *ex) for ex in examples], SEQ_LEN)
        out.append(epoch)
        have += epoch.shape[0]
    return torch.cat(out)[:rows], rows / out[0].shape[0]


def validation_set(tokenizer, rows: int = 64, tasks: int = 16) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """The fixed held-out measure: `rows` packed rows of renames on validation functions (for the loss) and
    the first `tasks` of them (for greedy continuations). Library code only, never pretrained on."""
    funcs = functions(corpus_files("validation"))
    random.Random(0).shuffle(funcs)
    examples = rename_examples(funcs, seed=0)
    val = pack_rows(tokenizer, [chat_example(tokenizer, *ex) for ex in examples], SEQ_LEN)[:rows]
    return val, examples[:tasks]


def measure(model, tokenizer) -> dict:
    """Held-out loss (nats/token) and greedy continuations of held-out renames."""
    val, tasks = validation_set(tokenizer)
    return {"held_out_loss": round(held_out_loss(model, val), 4), "held_out_tokens": int((val[:, 1] != -100).sum()),
            "held_out_continuations": continuations(model, tokenizer, tasks)}


def load_build(path: Path, option: str):
    """(model in float32, tokenizer) of a toy target build in `path`, given as `option` on the command line."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    if not (path / "config.json").exists():
        raise NotFoundError(f"{option} {path} holds no toy target; make one with `python -m dflash.target.toy build`")
    return Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def build_toy_target(dest: Path, steps: int = 1200, seed: int = 0, batch: int = 16, lr: float = 3e-3,
                     init: Path | None = None, layers: int | None = None, lookahead: tuple[int, ...] = (),
                     lookahead_weight: float = 0.3) -> dict:
    """Tokenizer + pretraining + save_pretrained into `dest`; returns the build record. With `init`, an
    earlier build (its tokenizer and weights) is trained further instead, and its record nested in this one.
    `layers`: the depth from scratch (8 when None), or the depth the `init` build grows to first (with zero
    output projections: dflash/target/lookahead.py). `lookahead`: offsets k; the last of the 5 layers a drafter
    reads also learns the token at q+k at each position q, its loss weighted `lookahead_weight`."""
    from transformers import Qwen3_5ForCausalLM, get_cosine_schedule_with_warmup

    t0 = time.time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train_funcs = functions(corpus_files("pretrain", tests=True))
    if init is not None:
        model, tokenizer = load_build(init, "--init")
        parent = json.loads((init / "toy_info.json").read_text()) if (init / "toy_info.json").exists() else {}
    else:
        tokenizer = build_tokenizer(corpus=rng.sample(train_funcs, 8000), vocab_size=VOCAB_SIZE)
        config = toy_config(len(tokenizer), layers or 8)
        config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config.pad_token_id = tokenizer.pad_token_id
        model = Qwen3_5ForCausalLM(config)
        parent = None
    grown_from = model.config.num_hidden_layers
    if layers is not None and layers != grown_from:
        model = deepen(model, layers)
    config = model.config
    heads = LookaheadHeads.attach(model, tuple(lookahead)) if lookahead else None
    log.info("toy tokenizer: %d tokens; %d training functions (%.0f s)", len(tokenizer), len(train_funcs),
             time.time() - t0)

    rows, epochs = pretraining_rows(tokenizer, train_funcs, steps * batch, seed)
    val = validation_set(tokenizer, rows=16)[0]
    params = list(model.parameters()) + (list(heads.parameters()) if heads is not None else [])
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps)
    model.train()
    curve = []
    for step in range(steps):
        x, y = rows[step * batch: (step + 1) * batch].unbind(1)
        loss = model(x, labels=y).loss
        ahead = heads.loss(y, model.lm_head.weight) if heads is not None else []
        (loss + lookahead_weight * sum(ahead)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            val_loss = held_out_loss(model, val)
            curve.append({"step": step, "loss": round(loss.item(), 4), "held_out_loss": round(val_loss, 4)}
                         | ({"lookahead_loss": [round(a.item(), 4) for a in ahead]} if ahead else {}))
            log.info("toy pretraining step %d/%d loss %.3f held-out %.3f lookahead %s (%.0f s)", step, steps,
                     loss.item(), val_loss, [round(a.item(), 3) for a in ahead], time.time() - t0)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.to(torch.bfloat16)  # bf16 on disk, small enough to ship; measured as shipped (bf16 weights, float32 math)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    held_out = measure(model.float(), tokenizer)
    record = {
        **held_out, "steps": steps, "batch": batch, "seq_len": SEQ_LEN, "train_tokens": steps * batch * SEQ_LEN,
        "epochs": round(epochs, 2), "train_functions": len(train_funcs), "seed": seed, "lr": lr,
        "params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
        "build_seconds": round(time.time() - t0, 1), "python": sys.version.split()[0], "torch": torch.__version__,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "curve": curve,
    }
    if config.num_hidden_layers != grown_from:
        record["grown_from_layers"] = grown_from
    if heads is not None:
        record["lookahead"] = {"offsets": list(heads.offsets), "layer": heads.layer, "weight": lookahead_weight}
    if parent is not None:
        record["init"] = {k: v for k, v in parent.items() if k != "held_out_continuations"}
    write_json(dest / "toy_info.json", record)
    cont = held_out["held_out_continuations"]
    log.info("toy target built in %.0f s: held-out loss %.3f nats/token; held-out renames end their turn %.0f%%, "
             "are right %.0f%% (lines right %.0f%%), repeated 4-grams %.2f", record["build_seconds"],
             record["held_out_loss"], 100 * cont["ended_turn"], 100 * cont["exact"], 100 * cont["lines_right"],
             cont["repeated_4gram_fraction"])
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
    b = sub.add_parser("build", help="tokenizer + pretraining from scratch (about 70 minutes on 2 cores)")
    b.add_argument("--out", type=Path, default=SHIPPED, help=f"output directory (default: {SHIPPED})")
    b.add_argument("--steps", type=int, default=1200)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine to 0, 5%% warmup)")
    b.add_argument("--init", type=Path, default=None, help="train an earlier build further instead of from scratch")
    b.add_argument("--layers", type=int, default=None,
                   help="depth (default 8); with --init, grow that build to it first")
    b.add_argument("--lookahead", type=lambda v: tuple(int(k) for k in v.split(",")), default=(),
                   help="offsets, e.g. 2,3,4: the last layer a drafter reads also learns the tokens that far ahead")
    b.add_argument("--lookahead-weight", type=float, default=0.3, help="weight of each lookahead loss")
    m = sub.add_parser("measure", help="held-out loss and greedy continuations of a built toy target")
    m.add_argument("--dir", type=Path, default=SHIPPED, help=f"toy target directory (default: {SHIPPED})")
    m.add_argument("--write", action="store_true", help="store the figures in its toy_info.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    if args.cmd == "build":
        record = build_toy_target(args.out, steps=args.steps, seed=args.seed, lr=args.lr, init=args.init,
                                  layers=args.layers, lookahead=args.lookahead,
                                  lookahead_weight=args.lookahead_weight)
    else:
        record = measure(*load_build(args.dir, "--dir"))
        if args.write:
            info = args.dir / "toy_info.json"
            write_json(info, {**(json.loads(info.read_text()) if info.exists() else {}), **record})
    cont = record["held_out_continuations"]
    for sample in cont["samples"][:3]:
        print(f"--- prompt\n{sample['prompt']}\n--- continuation\n{sample['continuation']}\n")
    print(json.dumps({k: v for k, v in record.items() if k != "held_out_continuations"}
                     | {k: v for k, v in cont.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
