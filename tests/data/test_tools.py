"""Tool-call conversations (dflash.data.tools): regenerated at every generation point on tiny_qwen3_tools, the target's
outputs scripted (a random tiny target writes no valid calls) by a stand-in for dflash.data.completions.generate_hf."""

import json

import pytest

from dflash.config import CompletionsConfig, ToolsConfig
from dflash.data import completions
from dflash.data.prompts import encode, normalize, prompt_text, prompts_hash
from dflash.data.sequences import prepare_sequences
from dflash.data.tools import parse_answer, steps, tool_items
from dflash.dist import Dist
from dflash.errors import DataError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather of a city", "parameters": CITY}}


def record(pid: str, city: str) -> dict:
    """OpenAI's format: the call's arguments a JSON string, its content null; a tool result, an answer, a second
    user turn and its answer. Generation points: after the question, after the result, after the thanks."""
    return {"id": pid, "tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
        {"role": "assistant", "content": f"It is 20C in {city}."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Welcome."}]}


def call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# what the scripted target writes, by the question of the conversation and the generation point (0-based)
SCRIPT = {("Paris", 0): call("Paris"),       # the recorded call: the recorded result follows
          ("Rome", 0): "Let me look.\n" + call("Milan"),  # another call: the conversation ends, unless keep_results
          ("Oslo", 0): '<tool_call>\n{"name": "get_weather", "arguments": {city: Oslo}}\n</tool_call>'}  # not JSON


def scripted(calls: list | None = None):
    """A generate_hf that answers from SCRIPT (else "Fine, <point>."), with the end-of-turn id a real generation
    ends on; calls: where to list the (question, point) of each answer."""
    def generate(target, texts, cfg, stop_ids):
        out = []
        for text in texts:
            city = text.split("Weather in ")[1].split("?")[0] if "Weather in " in text else "-"
            point = text.count("<|im_start|>assistant") - 1
            answer = SCRIPT.get((city, point), f"Fine, {point}.")
            if calls is not None:
                calls.append((city, point))
            ids = encode(target.tokenizer, answer) + [target.tokenizer.eos_token_id]
            out.append({"completion_ids": ids, "finish_reason": "stop", "stop_reason": ids[-1], "completion": answer})
        return out
    return generate


def prepare(target, prompts, store, **kw):
    return prepare_sequences(prompts, "tools.jsonl", target, CompletionsConfig(source="hf", max_new_tokens=32,
                                                                               batch_size=kw.pop("batch_size", 8)),
                             store, Dist(), chat_template=True, enable_thinking=False, max_length=None, **kw)


def test_records_keep_their_tools_calls_and_results_and_text_records_their_ids_and_hashes():
    (p,) = normalize([record("w", "Paris")])
    assert p.tools == [WEATHER] and p.messages == [{"role": "user", "content": "Weather in Paris?"}]
    assert p.conversation[1]["content"] == "" and p.conversation[1]["tool_calls"][0]["id"] == "c1"
    assert p.conversation[2] == {"role": "tool", "content": "20C", "tool_call_id": "c1"}
    assert [s.end for s in steps(p)] == [1, 3, 5] and steps(p)[0].results == [p.conversation[2]]
    text = normalize([{"messages": [{"role": "user", "content": "hi", "name": "ann"}]}])
    assert text[0].messages == [{"role": "user", "content": "hi"}] and text[0].conversation == [] and not text[0].tools
    assert prompts_hash(text) == prompts_hash(normalize([{"prompt": "hi"}]))  # tools add to the hash only if listed
    (stored,) = normalize([{**record("w", "Paris"), "tools": json.dumps([WEATHER])}])  # as some datasets store them
    assert stored.tools == [WEATHER] and prompts_hash([stored]) != prompts_hash(normalize([{**record("w", "Paris"),
                                                                                            "tools": []}]))


def test_the_target_regenerates_every_assistant_turn_and_the_loss_covers_its_answers_only(
        tools_target, tmp_path, monkeypatch):
    """The recorded call: its result follows, three sequences (after the question, the result, the thanks); another
    call: the conversation ends there (counted), or with data.tools.keep_results the recorded result follows the
    target's own call. Each sequence's loss covers the target's answer, its text and tool-call tokens and the end of
    its turn, nothing of the tool results or user turns."""
    tok = tools_target.tokenizer
    monkeypatch.setattr(completions, "generate_hf", scripted())
    prompts = normalize([record("same", "Paris"), record("other", "Rome"), {"id": "text", "prompt": "hello"}])
    ended = prepare(tools_target, prompts, tmp_path / "a.jsonl")
    by_id = {s.id: s for s in ended.sequences}
    assert sorted(by_id) == ["other", "same", "same:turn2", "same:turn3", "text"]
    tools = ended.info["tools"]
    assert (tools["conversations"], tools["ended_by_differing_call"], tools["results_kept_after_differing_call"]) == (
        2, 1, 0)
    # tool turns: a call (the first answers), an answer to tool results; the answer to the thanks is a text turn
    assert sorted(tools["items"]) == ["other", "same", "same:turn2"] and ended.info["regenerate"] == "all_turns"
    assert ended.info["tool_results_kept"] is False
    second = by_id["same:turn2"]  # after the target's own call, as the template renders it, and the recorded result
    own = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    context = prompts[0].conversation[:1] + [own, prompts[0].conversation[2]]
    prompt_ids = encode(tok, prompt_text(tok, context, True, False, tools=[WEATHER]))
    assert second.input_ids[: len(prompt_ids)].tolist() == prompt_ids and not second.loss_mask[: len(prompt_ids)].any()
    assert tok.decode(second.input_ids[second.loss_mask]) == "Fine, 1.<|im_end|>"
    assert "<tool_response>\n20C\n</tool_response>" in tok.decode(second.input_ids[~second.loss_mask])
    first = by_id["same"]
    assert tok.decode(first.input_ids[first.loss_mask]) == call("Paris") + "<|im_end|>"  # the call's tokens trained
    assert "<tools>" in tok.decode(first.input_ids[~first.loss_mask])
    third = by_id["same:turn3"]
    assert tok.decode(third.input_ids[~third.loss_mask]).endswith("Thanks!<|im_end|>\n<|im_start|>assistant\n"
                                                                  "<think>\n\n</think>\n\n")
    assert "Fine, 1." in tok.decode(third.input_ids[~third.loss_mask])  # its own answer, not the record's

    kept = prepare(tools_target, prompts, tmp_path / "a.jsonl", tools=ToolsConfig(keep_results=True))
    by_id = {s.id: s for s in kept.sequences}
    assert sorted(by_id) == ["other", "other:turn2", "other:turn3", "same", "same:turn2", "same:turn3", "text"]
    assert (kept.info["tools"]["ended_by_differing_call"], kept.info["tools"]["results_kept_after_differing_call"]) == (
        0, 1)
    context = tok.decode(by_id["other:turn2"].input_ids[~by_id["other:turn2"].loss_mask])
    assert ("Let me look.\n" + call("Milan") + "<|im_end|>\n<|im_start|>user\n<tool_response>\n20C\n") in context


def test_a_call_that_is_not_json_is_refused_in_one_line_or_skipped_and_counted(tools_target, tmp_path, monkeypatch):
    monkeypatch.setattr(completions, "generate_hf", scripted())
    prompts = normalize([record("same", "Paris"), record("bad", "Oslo")])
    with pytest.raises(DataError, match=r"^tools.jsonl record bad: the target's tool call at turn 1 \(bad\) is not "
                                        r"valid JSON .*data.skip_bad_records=true[^\n]*$"):
        prepare(tools_target, prompts, tmp_path / "a.jsonl")
    skipped = prepare(tools_target, prompts, tmp_path / "a.jsonl", skip_bad_records=True)
    assert sorted(s.id for s in skipped.sequences) == ["same", "same:turn2", "same:turn3"]
    assert skipped.info["skipped"]["bad_records"] == 1 and "bad" not in skipped.info["tools"]["items"]


def test_a_tools_record_the_template_cannot_render_is_refused_or_skipped(tiny_targets, tmp_path, monkeypatch):
    """tiny_qwen3's template ignores tools: each tools record is bad; the text record is kept."""
    monkeypatch.setattr(completions, "generate_hf", scripted())
    prompts = normalize([record("w", "Paris"), {"id": "text", "prompt": "hello"}])
    with pytest.raises(DataError, match=r"^tools.jsonl record w: the chat template does not render its tools"):
        prepare(tiny_targets["tiny_qwen3"], prompts, tmp_path / "a.jsonl")
    skipped = prepare(tiny_targets["tiny_qwen3"], prompts, tmp_path / "a.jsonl", skip_bad_records=True)
    assert [s.id for s in skipped.sequences] == ["text"] and skipped.info["skipped"]["bad_records"] == 1
    broken = {**record("x", "Paris"), "id": "x"}
    broken["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(DataError, match=r"record x: turn 2 has a tool call whose arguments are not JSON"):
        prepare(tiny_targets["tiny_qwen3"], normalize([broken]), tmp_path / "b.jsonl")


def resumable():
    """The prompts and settings the kill test regenerates (tests.data.tools_probe too): 7 answers, one a batch."""
    prompts = normalize([record("same", "Paris"), record("other", "Rome"), {"id": "text", "prompt": "hello"}])
    return prompts, {"tools": ToolsConfig(keep_results=True), "batch_size": 1}


def test_regeneration_of_tool_conversations_killed_resumes_to_what_one_run_makes(tools_target, tmp_path, monkeypatch):
    """Killed (SIGKILL) with 3 or more of the 7 answers stored, each stored as it finishes, a rerun generates only
    the others and ends with the sequences and counts of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    prompts, kw = resumable()
    monkeypatch.setattr(completions, "generate_hf", scripted())
    whole = prepare(tools_target, prompts, tmp_path / "whole.jsonl", **kw)
    store = tmp_path / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.data.tools_probe", str(store)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not store.exists() or len(store.read_text().splitlines()) < 3:
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stored = {json.loads(line)["id"] for line in store.read_text().splitlines() if line.endswith("}")}
    assert 3 <= len(stored) < 7
    rest: list = []
    monkeypatch.setattr(completions, "generate_hf", scripted(rest))
    resumed = prepare(tools_target, prompts, store, **kw)
    assert len(rest) == 7 - len(stored)
    assert [(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in resumed.sequences] == [
        (s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in whole.sequences]
    assert {k: v for k, v in resumed.info.items() if k != "completions"} == {
        k: v for k, v in whole.info.items() if k != "completions"}


def test_the_targets_calls_are_read_from_its_tool_call_blocks():
    assert parse_answer("plain text") == {"role": "assistant", "content": "plain text"}
    own = parse_answer("Sure.\n" + call("Paris") + "\n" + call("Lyon"))
    assert own["content"] == "Sure." and [c["function"]["arguments"] for c in own["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Lyon"}]
    with pytest.raises(ValueError, match="not closed"):
        parse_answer('<tool_call>\n{"name": "f", "arguments": {}}')
    assert parse_answer('<tool_call>\n{"name": "f", "argu', cut=True)["tool_calls"] == []  # cut at the budget
    with pytest.raises(ValueError, match="is not a call"):
        parse_answer('<tool_call>["f"]</tool_call>')


def test_a_mixtures_tool_turns_carry_their_sources_name():
    from dflash.config import DataConfig
    from dflash.data.mixture import Source, merge
    from dflash.data.sequences import Prepared

    data = DataConfig(name="t", prompts="p.jsonl")
    parts = [(Source(name, data), Prepared([], {"num_prompts": 1, "tools": {"items": ["w", "w:turn2"]}}))
             for name in ("think", "plain")]
    assert tool_items(merge(parts).info) == {"think/w", "think/w:turn2", "plain/w", "plain/w:turn2"}
    assert tool_items({"tools": {"items": ["w"]}}) == {"w"} and tool_items({}) == set()


def test_training_data_takes_data_tools_and_data_skip_bad_records(tools_target, tmp_path, monkeypatch):
    """extract.py's and online training's sequences (dflash.data.extraction.prepare_training) follow the data.* keys."""
    from dflash.data.extraction import prepare_training
    from tests.conftest import compose

    monkeypatch.setattr(completions, "generate_hf", scripted())
    prompts = tmp_path / "tools.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (record("other", "Rome"), record("bad", "Oslo"))))
    job = compose("train", ["debug=tiny", "target=tiny_qwen3_tools", f"data.prompts={prompts}",
                            f"features.dir={tmp_path}/features", "data.tools.keep_results=true",
                            "data.skip_bad_records=true", "data.max_length=1024"])  # the tools take 500 bytes
    prepared = prepare_training(job, tools_target, Dist())
    assert sorted(s.id for s in prepared.sequences) == ["other", "other:turn2", "other:turn3"]
    assert prepared.info["skipped"]["bad_records"] == 1 and prepared.info["tool_results_kept"] is True


def test_a_two_source_mixture_regenerates_tool_conversations_in_each_sources_rendering(tools_target, tmp_path,
                                                                                        monkeypatch):
    """data.sources with thinking on and off over tool conversations (issue 51's done-when): each source answers
    every generation point in its own rendering (thinking off: the empty think block before each answer), the
    recorded results after its own matching calls; sequences <source>/<id>[:turnN], the tool turns listed per source,
    the loss on the answers only."""
    from dflash.data.extraction import prepare_training
    from tests.conftest import compose

    calls = []
    monkeypatch.setattr(completions, "generate_hf", scripted(calls))
    prompts = tmp_path / "tools.jsonl"
    prompts.write_text(json.dumps(record("paris", "Paris")) + "\n")
    sources = (f"data.sources=[{{prompts: {prompts}, weight: 0.6, enable_thinking: true, name: think}}, "
               f"{{prompts: {prompts}, weight: 0.4, enable_thinking: false, name: plain}}]")
    job = compose("train", ["debug=tiny", "target=tiny_qwen3_tools", sources, f"features.dir={tmp_path}/features",
                            "data.max_length=1024"])
    prepared = prepare_training(job, tools_target, Dist())
    by_id = {s.id: s for s in prepared.sequences}
    points = ["paris", "paris:turn2", "paris:turn3"]
    assert sorted(by_id) == sorted(f"{v}/{p}" for v in ("think", "plain") for p in points)
    assert sorted(calls) == sorted([("Paris", 0), ("Paris", 1), ("Paris", 2)] * 2)  # every point, once a source
    assert tool_items(prepared.info) == {f"{v}/{p}" for v in ("think", "plain") for p in points[:2]}  # call, result
    empty_think = encode(tools_target.tokenizer, "<think>\n\n</think>")

    def split(seq) -> tuple[list[int], list[int]]:  # (the context, the answer: the tokens the loss covers)
        ids, answer = [int(i) for i in seq.input_ids], int(sum(seq.loss_mask))
        return ids[: len(ids) - answer], ids[len(ids) - answer:]

    def contains(ids: list[int], sub: list[int]) -> bool:
        return any(ids[i:i + len(sub)] == sub for i in range(len(ids)))

    for p in points:
        (think, think_answer), (plain, plain_answer) = split(by_id[f"think/{p}"]), split(by_id[f"plain/{p}"])
        assert contains(plain, empty_think) and not contains(think, empty_think)
        # the answer is the scripted one in both renderings: the loss covers it and nothing else
        assert think_answer == plain_answer
