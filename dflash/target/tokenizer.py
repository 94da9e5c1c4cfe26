"""Byte-level BPE tokenizers for the built-in targets, with a Qwen-style chat template.

The tiny test targets use the 256 byte symbols and no merges; the toy target trains merges on
a local corpus. Both carry the chat special tokens and a dedicated mask token, and save with
`save_pretrained` so they load back through `AutoTokenizer` like any real tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]

# Qwen3-style: system/user/assistant turns between <|im_start|> and <|im_end|>; with thinking
# off the generation prompt carries an empty think block, as Qwen3 does.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: bytes only (no corpus) or `vocab_size` tokens trained on `corpus`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if corpus is None:
        tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if corpus is not None:
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                      special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
    else:
        tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The chat-templated user turn and the assistant's opening (thinking off), as the target is prompted."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return tokenizer(head, add_special_tokens=False)["input_ids"]
