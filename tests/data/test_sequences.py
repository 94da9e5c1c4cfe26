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


def two_turn_prompts():
    from dflash.data.prompts import normalize

    return normalize([
        {"id": "c", "messages": [{"role": "user", "content": "write a loop"}, {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": "now in reverse"},
                                 {"role": "assistant", "content": "done"}]},
        {"id": "m", "turns": ["name a color", "and another"]},
        {"id": "o", "prompt": "one turn only"}])


def test_every_assistant_turn_is_regenerated_after_the_targets_own_earlier_answers(tmp_path, tiny_targets):
    """data.regenerate=all_turns: a sequence per user turn, turn two's prompt holding the target's answer to turn
    one (its completion's text), the loss on that turn's answer only."""
    from dflash.data.prompts import encode, prompt_text, turn_messages

    target = tiny_targets["tiny_qwen3"]
    prompts = two_turn_prompts()
    cfg = CompletionsConfig(source="hf", max_new_tokens=6)
    store = tmp_path / "c.jsonl"
    prepared = prepare_sequences(prompts, "test", target, cfg, store, Dist(), chat_template=True,
                                 enable_thinking=False, max_length=None, regenerate="all_turns")
    by_id = {s.id: s for s in prepared.sequences}
    assert sorted(by_id) == ["c", "c:turn2", "m", "m:turn2", "o"] and prepared.info["regenerate"] == "all_turns"
    stored = {json.loads(line)["id"]: json.loads(line) for line in store.read_text().splitlines()}
    for pid in ("c", "m"):
        first, second = by_id[pid], by_id[f"{pid}:turn2"]
        answer = stored[pid]["completion"]
        messages = turn_messages(next(p for p in prompts if p.id == pid), 1, [answer])
        assert messages[-2] == {"role": "assistant", "content": answer}
        prompt_ids = encode(target.tokenizer, prompt_text(target.tokenizer, messages, True, False))
        assert second.input_ids[: len(prompt_ids)].tolist() == prompt_ids
        assert not second.loss_mask[: len(prompt_ids)].any() and second.loss_mask[len(prompt_ids):].all()
        assert first.input_ids[first.loss_mask].tolist() == stored[pid]["completion_ids"]


def test_last_turn_keeps_the_conversations_own_earlier_turns(tmp_path, tiny_targets):
    from dflash.data.prompts import encode, prompt_text

    target = tiny_targets["tiny_qwen3"]
    c, _, o = two_turn_prompts()
    prepared = prepare_sequences([c, o], "test", target, CompletionsConfig(source="hf", max_new_tokens=6),
                                 tmp_path / "c.jsonl", Dist(), chat_template=True, enable_thinking=False,
                                 max_length=None, regenerate="last_turn")
    by_id = {s.id: s for s in prepared.sequences}
    assert sorted(by_id) == ["c:turn2", "o"]
    prompt_ids = encode(target.tokenizer, prompt_text(target.tokenizer, c.conversation[:3], True, False))
    assert by_id["c:turn2"].input_ids[: len(prompt_ids)].tolist() == prompt_ids  # "ok", the record's answer
    first = prepare_sequences([c, o], "test", target, CompletionsConfig(source="hf", max_new_tokens=6),
                              tmp_path / "c.jsonl", Dist(), chat_template=True, enable_thinking=False,
                              max_length=None, regenerate="first_turn")
    assert sorted(s.id for s in first.sequences) == ["c", "o"]


def test_truncated_completions_are_kept_or_dropped_and_counted_either_way(tmp_path, tiny_targets):
    """A completion that reached max_new_tokens before the end of its turn (finish_reason "length"): kept by default,
    dropped with data.completions.truncated=drop; the manifest's info counts it both ways."""
    target = tiny_targets["tiny_qwen3"]
    prompts = [Prompt(p, [{"role": "user", "content": p}]) for p in ("a", "b", "c")]
    store = tmp_path / "c.jsonl"
    store.write_text("".join(json.dumps({"id": p, "completion": "xy", "completion_ids": [120, 121, 62],
                                         "finish_reason": reason}) + "\n"
                             for p, reason in (("a", "stop"), ("b", "length"), ("c", "length"))))
    kept, dropped = (prepare_sequences(prompts, "test", target, CompletionsConfig(source="cached", path=str(store),
                                                                                  truncated=how),
                                       store, Dist(), chat_template=True, enable_thinking=False, max_length=None)
                     for how in ("keep", "drop"))
    assert kept.info["truncated"] == dropped.info["truncated"] == 2
    assert [s.id for s in kept.sequences] == ["a", "b", "c"] and [s.id for s in dropped.sequences] == ["a"]
    assert dropped.info["skipped"]["truncated"] == 2 and dropped.info["truncated_kept"] is False
    assert "truncated_kept" not in kept.info  # keep is the old behaviour: its manifests unchanged but the count
