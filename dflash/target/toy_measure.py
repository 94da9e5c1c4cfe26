"""Measures of a toy target build (dflash/target/toy.py): its mean loss per answer token on held-out
rows, and its greedy chat continuations of held-out tasks (do they end their turn, are they right, do
they repeat themselves)."""

from __future__ import annotations

import torch

from dflash.target.tokenizer import prompt_ids


@torch.no_grad()
def held_out_loss(model, rows: torch.Tensor, batch: int = 16) -> float:
    """Mean loss (nats) per answer token of the (rows, 2, seq_len) ids and labels of `pack_rows`."""
    model.eval()
    total, count = 0.0, 0
    for s in range(0, rows.shape[0], batch):
        x, y = rows[s: s + batch].unbind(1)
        n = int((y[:, 1:] != -100).sum())
        total += model(x, labels=y).loss.item() * n
        count += n
    model.train()
    return total / max(count, 1)


def repeated_ngram_fraction(ids: list[int], n: int = 4) -> float:
    """Share of the n-grams of `ids` that already occurred earlier in it: 0 for fresh text, near 1 for a loop."""
    grams = [tuple(ids[i: i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def continuations(model, tokenizer, tasks: list[tuple[str, str]], max_new_tokens: int = 256) -> dict:
    """Greedy chat completions of the (prompt, answer) `tasks`: how often they end their turn, how often they
    are the answer exactly, how much of the answer's lines they get right, how much they repeat; samples."""
    model.eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples, ended, exact, lines, repeated, lengths = [], 0, 0, [], [], []
    for prompt, answer in tasks:
        ids = torch.tensor([prompt_ids(tokenizer, prompt)])
        new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        text = tokenizer.decode(new, skip_special_tokens=False)
        ended += bool(new) and new[-1] == eos
        exact += text == answer + "<|im_end|>"
        want, got = answer.splitlines(), text.removesuffix("<|im_end|>").splitlines()
        lines.append(sum(a == b for a, b in zip(want, got)) / max(len(want), len(got)))
        repeated.append(repeated_ngram_fraction(new))
        lengths.append(len(new))
        samples.append({"prompt": prompt, "continuation": text})
    model.train()
    n = len(tasks)
    return {"prompts": n, "max_new_tokens": max_new_tokens, "ended_turn": round(ended / n, 3),
            "exact": round(exact / n, 3), "lines_right": round(sum(lines) / n, 3),
            "repeated_4gram_fraction": round(sum(repeated) / n, 3),
            "mean_new_tokens": round(sum(lengths) / n, 1), "samples": samples}
