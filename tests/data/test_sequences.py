"""Training sequences: prompt + the target's completion, the loss mask on the response."""

import json

from dflash.config import CompletionsConfig
from dflash.data.prompts import Prompt
from dflash.data.sequences import prepare_sequences
from dflash.dist import Dist


def test_re_tokenized_completions_are_counted_in_what_the_manifest_records(tmp_path, tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    prompts = [Prompt("a", [{"role": "user", "content": "hello"}]), Prompt("b", [{"role": "user", "content": "hi"}])]
    store = tmp_path / "c.jsonl"
    store.write_text(json.dumps({"id": "a", "completion": "text only"}) + "\n"
                     + json.dumps({"id": "b", "completion": "xy", "completion_ids": [120, 121, 62]}) + "\n")
    prepared = prepare_sequences(prompts, "test", target, CompletionsConfig(source="cached", path=str(store)), store,
                                 Dist(), chat_template=True, enable_thinking=False, max_length=None)
    assert prepared.info["completions_retokenized"] == 1 and prepared.info["num_sequences"] == 2
    b = next(s for s in prepared.sequences if s.id == "b")
    assert b.input_ids[b.loss_mask].tolist() == [120, 121, 62]  # the response, labelled as generated
