import json

import pytest

from dflash.data.prompts import load_prompts, prompts_hash
from dflash.errors import DataError
from dflash.data.sequences import build_sequence


def test_builtin_eval_prompts_are_the_ten_coding_tasks():
    ids = [p.id for p in load_prompts("builtin:eval_coding")]
    assert ids == ["fizzbuzz", "binary_search", "linked_list_reverse", "json_parser", "async_rate_limiter",
                   "trie_autocomplete", "merge_sort", "lru_cache", "graph_bfs", "matrix_multiply"]


def test_unknown_builtin_lists_the_available_sets():
    with pytest.raises(FileNotFoundError, match="builtin:eval_coding"):
        load_prompts("builtin:nope")


def test_jsonl_parquet_and_directories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "a", "prompt": "hello"},
            {"id": "b", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "old answer"}]},
            {"conversations": [{"from": "human", "value": "sharegpt style"}, {"from": "gpt", "value": "x"}]}]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    pq.write_table(pa.Table.from_pylist([{"id": "c", "text": "from parquet"}]), tmp_path / "d" / "q.parquet")
    prompts = load_prompts(str(tmp_path / "d"))
    assert [p.id for p in prompts] == ["a", "b", "c"]
    assert prompts[1].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (tmp_path / "s.jsonl").write_text(json.dumps(rows[2]) + "\n")
    sg = load_prompts(str(tmp_path / "s.jsonl"))[0]
    assert sg.messages == [{"role": "user", "content": "sharegpt style"}] and len(sg.id) == 16
    assert prompts_hash(prompts) == prompts_hash(load_prompts(str(tmp_path / "d")))
    assert [p.id for p in load_prompts(str(tmp_path / "d"), offset=1, limit=1)] == ["b"]


def test_hf_dataset_from_local_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"id": "x", "prompt": "saved"}]).save_to_disk(str(tmp_path / "saved"))
    assert load_prompts(str(tmp_path / "saved"), fmt="hf")[0].messages[0]["content"] == "saved"
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.jsonl").write_text(json.dumps({"id": "y", "prompt": "raw files"}) + "\n")
    assert load_prompts(str(tmp_path / "raw"), fmt="hf")[0].id == "y"


def test_bad_records_name_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "prompt": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(str(tmp_path / "bad.jsonl"))
    (tmp_path / "nofield.jsonl").write_text('{"id": 1, "body": "x"}\n')
    with pytest.raises(ValueError, match="data.prompt_key"):
        load_prompts(str(tmp_path / "nofield.jsonl"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_sequence_masks_the_response_and_truncates():
    seq = build_sequence("x", [1, 2, 3], [4, 5, 6, 7], max_length=6)
    assert seq.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert seq.loss_mask.tolist() == [False, False, False, True, True, True]
    assert build_sequence("x", [1] * 5, [4, 5], max_length=6) is None  # no room for two response tokens


def test_conversations_keep_their_later_turns_and_each_turn_has_its_messages():
    from dflash.data.prompts import normalize, turn_id, turn_messages

    chat = {"id": "c", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                                    {"role": "assistant", "content": "a2"}]}
    mt = {"id": "m", "turns": ["first question", "follow-up"]}  # MT-Bench: user turns, no answers
    one = {"id": "o", "prompt": "alone"}
    c, m, o = normalize([chat, mt, one])
    assert c.messages == chat["messages"][:2] and c.user_turns == 2 and m.user_turns == 2 and o.user_turns == 1
    assert o.conversation == [] and m.messages == [{"role": "user", "content": "first question"}]
    # all_turns: the earlier assistant turn is the target's own answer
    assert turn_messages(c, 1, ["mine"]) == [chat["messages"][0], chat["messages"][1],
                                            {"role": "assistant", "content": "mine"}, chat["messages"][3]]
    # last_turn: the conversation's own earlier turns
    assert turn_messages(c, 1) == chat["messages"][:4]
    assert turn_messages(m, 1, ["A"]) == [{"role": "user", "content": "first question"},
                                         {"role": "assistant", "content": "A"}, {"role": "user", "content": "follow-up"}]
    with pytest.raises(DataError, match="no assistant turn after it"):
        turn_messages(m, 1)  # nothing to keep: only the target can answer turn one
    assert [turn_id("c", t) for t in range(3)] == ["c", "c:turn2", "c:turn3"]


def test_a_chat_template_the_tokenizer_lacks_is_refused_before_anything_is_generated(tmp_path, tiny_targets):
    """A base model (Gemma 3 270M's GGUF carries no chat template) asked for chat prompts: one line saying to set
    data.chat_template=false, before a completion is generated; plain text joins the turns."""
    import copy

    from dflash.config import CompletionsConfig
    from dflash.data.prompts import Prompt, prompt_text
    from dflash.data.sequences import prepare_sequences
    from dflash.dist import Dist
    from dflash.errors import ConfigError

    base = copy.copy(tiny_targets["tiny_qwen3"])
    base.tokenizer = copy.deepcopy(base.tokenizer)
    base.tokenizer.chat_template = None
    prompts = [Prompt("a", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])]
    store = tmp_path / "c.jsonl"
    with pytest.raises(ConfigError, match=r"has no chat template: set data.chat_template=false \(plain-text prompts"):
        prepare_sequences(prompts, "test", base, CompletionsConfig(max_new_tokens=4), store, Dist(),
                          chat_template=True, enable_thinking=False, max_length=None)
    assert not store.exists()
    assert prompt_text(base.tokenizer, prompts[0], False, None) == "be brief\n\nhello"


def test_a_chat_template_that_drops_the_system_turn_is_refused(tiny_targets):
    """The target would answer another conversation than the recorded one: refused, naming the prompt, rather than
    merging the system turn into the user's (a format of ours, not the model's)."""
    import copy

    from dflash.data.prompts import Prompt, prompt_text

    tok = tiny_targets["tiny_qwen3"].tokenizer
    chat = Prompt("s", [{"role": "system", "content": "Answer in French. "}, {"role": "user", "content": "hello"}])
    assert "Answer in French." in prompt_text(tok, chat, True, False)  # ChatML renders it
    dropping = copy.deepcopy(tok)
    dropping.chat_template = ("{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                              "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    with pytest.raises(DataError, match=r"leaves the system turn 'Answer in French. ' out of the text of sharegpt "
                                        r"prompt s; remove system turns"):
        prompt_text(dropping, chat, True, False, where="sharegpt prompt s")
    assert "hello" in prompt_text(dropping, [chat.messages[1]], True, False)  # no system turn: nothing to drop


def test_a_plain_text_prompt_starts_with_the_bos_its_tokenizer_adds():
    """data.chat_template=false: prompts are encoded without special tokens, so a tokenizer that puts a bos before a
    text (Gemma's <bos>, as a completions endpoint adds it) gets it in the text; one that adds none gets none."""
    from dflash.data.prompts import prompt_text

    class Tok:
        def __init__(self, adds):
            self.bos_token, self.bos_token_id, self.adds = "<bos>", 2, adds

        def __call__(self, text):
            return {"input_ids": ([2] if self.adds else []) + [7] * len(text)}

    messages = [{"role": "user", "content": "The capital of France is"}]
    assert prompt_text(Tok(True), messages, False, None) == "<bos>The capital of France is"
    assert prompt_text(Tok(False), messages, False, None) == "The capital of France is"
    assert prompt_text(Tok(True), [{"role": "user", "content": "<bos>x"}], False, None) == "<bos>x"
