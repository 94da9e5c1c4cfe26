"""The mask token: the embedding row a drafter reads at every masked block slot.

It must be a token the target never writes: the drafter learns "this slot is unknown" from it, and a token the
model also writes (its end of turn, padding, a token of its chat template) would make the block's real input and
the mask look alike. A vocabulary without a spare row (SmolLM2's 49152 rows are all tokens) offers special tokens
its chat use never produces (SmolLM2: <empty_output>, a code-data marker).

The id alone cannot tell which model it was chosen for, so presets also give its text (target.mask_token): pointing
a preset at another model's folder (target.path) with the preset's id is refused when the folder's tokenizer has
another token there, instead of training silently on whatever that id is in the new vocabulary.
"""

from __future__ import annotations

import logging

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

OWN_MODEL = "a model of your own needs its own target keys: README, Train a drafter for your own model"

SAMPLE_CHATS = (
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "v"}],
    [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}],
    [{"role": "user", "content": "u"}],
)
"""Conversations rendered to find the tokens a chat template writes (the first one the template accepts)."""


def token_text(tokenizer, token_id: int) -> str:
    """The token's text in the tokenizer, "" for an id past its tokens (an embedding row no token uses)."""
    if token_id >= len(tokenizer):
        return ""
    text = tokenizer.convert_ids_to_tokens(token_id)
    return "" if text is None else str(text)


def written_tokens(tokenizer, generation_config=None) -> dict[int, str]:
    """{id: why} for the tokens the target writes as structure: its end-of-turn, padding, bos and unknown tokens, its generation
    config's eos tokens, and every token its chat template renders around messages (a sample chat, with the
    generation prompt)."""
    out: dict[int, str] = {}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            out.setdefault(value, f"its {name.removesuffix('_id').replace('_', ' ')}")
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in eos if isinstance(eos, list) else [] if eos is None else [eos]:
        out.setdefault(int(value), "an eos token of its generation config")
    if getattr(tokenizer, "chat_template", None):
        for chat in SAMPLE_CHATS:
            try:
                ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
            except Exception:  # noqa: BLE001  (templates refuse system turns or other orders: try the next chat)
                continue
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            for value in ids:
                out.setdefault(int(value), "a token its chat template writes")
            break
    return out


def check_mask_token(cfg, tokenizer, rows: int, generation_config=None) -> None:
    """Refuse, in one line, a target.mask_token_id outside the embedding's `rows`, one whose text is not the
    preset's target.mask_token (the preset applied to another model), or one the target writes."""
    mid = cfg.mask_token_id
    if not 0 <= mid < rows:
        raise ConfigError(f"target.mask_token_id={mid} is outside the target's vocabulary [0, {rows}); set the id of "
                          f"a token {cfg.name} never writes ({OWN_MODEL})")
    if tokenizer is None:
        return
    text = token_text(tokenizer, mid)
    if cfg.mask_token is not None and text != cfg.mask_token:
        raise ConfigError(f"target.mask_token_id={mid} is {text or 'no token'!r} in the tokenizer of {cfg.path}, but "
                          f"target {cfg.name} means {cfg.mask_token or 'a row past the tokenizer'!r} there: this is "
                          f"another model than the preset's; set target.mask_token_id and target.mask_token to a "
                          f"token it never writes ({OWN_MODEL})")
    why = written_tokens(tokenizer, generation_config).get(mid)
    if why is not None:
        raise ConfigError(f"target.mask_token_id={mid} ({text!r}) is {why}: the drafter could not tell a masked slot "
                          f"from that token; choose a token {cfg.name} never writes (an unused special token, or "
                          f"a row past the tokenizer's {len(tokenizer)} tokens)")
