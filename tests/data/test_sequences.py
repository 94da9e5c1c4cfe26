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


def test_a_server_stop_on_end_of_sequence_labels_the_targets_own_eos_not_a_fixed_im_end(tmp_path, tiny_targets):
    """vLLM says stop_reason null when it stopped on the tokenizer's eos: that id is the label, whatever the target's
    eos is (here <|endoftext|>, while the vocabulary also holds an <|im_end|> the target did not write)."""
    import copy

    from tests.stub_server import StubServer

    target = copy.copy(tiny_targets["tiny_qwen3"])
    target.tokenizer = copy.deepcopy(target.tokenizer)
    target.tokenizer.eos_token = "<|endoftext|>"
    eos, im_end = target.tokenizer.eos_token_id, target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos != im_end
    stub = StubServer(choice={"stop_reason": None}).start()
    try:
        cfg = CompletionsConfig(source="server", url=stub.url, ready_timeout_s=10.0, retries=1, token_ids=False)
        prepared = prepare_sequences([Prompt("a", [{"role": "user", "content": "hello"}])], "test", target, cfg,
                                     tmp_path / "c.jsonl", Dist(), chat_template=True, enable_thinking=False,
                                     max_length=None)
    finally:
        stub.stop()
    (seq,) = prepared.sequences
    assert seq.input_ids[seq.loss_mask].tolist()[-1] == eos
