import json

import pytest
import torch

from dflash.config import CompletionsConfig
from dflash.data.completions import completion_ids, obtain, read_store, server_record
from dflash.dist import Dist
from dflash.errors import CompletionsError
from tests.stub_server import StubServer

PROMPTS = [(f"p{i}", f"prompt number {i}") for i in range(5)]
SETTINGS = {"target": "abc", "max_new_tokens": 8}


def server_cfg(url, **kw):
    base = {"source": "server", "url": url, "ready_timeout_s": 10.0, "request_timeout_s": 5.0, "retries": 3,
            "concurrency": 2, "max_new_tokens": 8}
    return CompletionsConfig(**{**base, **kw})


@pytest.fixture
def server():
    s = StubServer().start()
    yield s
    s.stop()


def test_cached_source_never_contacts_the_server(tmp_path, server):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": pid, "completion": "done"}) + "\n" for pid, _ in PROMPTS))
    cfg = CompletionsConfig(source="cached", path=str(path), url=server.url)
    records = obtain(cfg, path, PROMPTS, SETTINGS, Dist())
    assert len(records) == 5 and server.calls == {"models": 0, "completions": 0}


def test_cached_source_without_file_says_what_to_do(tmp_path):
    cfg = CompletionsConfig(source="cached", path=str(tmp_path / "none.jsonl"))
    with pytest.raises(CompletionsError, match="does not exist"):
        obtain(cfg, tmp_path / "none.jsonl", PROMPTS, SETTINGS, Dist())


def test_server_source_generates_stores_and_resumes(tmp_path, server):
    path = tmp_path / "c.jsonl"
    records = obtain(server_cfg(server.url), path, PROMPTS[:3], SETTINGS, Dist(), model="m", eos_id=99)
    assert len(records) == 3 and server.calls["completions"] == 3
    assert records["p0"]["finish_reason"] == "stop" and records["p0"]["completion"].startswith(" reply to")
    with path.open("a") as f:
        f.write('{"id": "p3", "compl')  # a write cut short by a crash
    records = obtain(server_cfg(server.url), path, PROMPTS, SETTINGS, Dist(), model="m", eos_id=99)
    assert len(records) == 5 and server.calls["completions"] == 5  # only p3 and p4 were generated


def test_server_that_starts_late_is_waited_for(tmp_path):
    late = StubServer().start(after_s=2.0)
    try:
        records = obtain(server_cfg(late.url), tmp_path / "c.jsonl", PROMPTS[:2], SETTINGS, Dist())
        assert len(records) == 2 and late.calls["models"] >= 1
    finally:
        late.stop()


def test_server_down_fails_with_the_url_and_the_fix(tmp_path):
    cfg = server_cfg("http://127.0.0.1:9/v1", ready_timeout_s=1.0)
    with pytest.raises(CompletionsError, match=r"no completions server answered at http://127.0.0.1:9/v1.*"
                                              r"data.completions.url"):
        obtain(cfg, tmp_path / "c.jsonl", PROMPTS, SETTINGS, Dist())


def test_transient_errors_are_retried(tmp_path):
    flaky = StubServer(fail_first=2).start()
    try:
        records = obtain(server_cfg(flaky.url, concurrency=1), tmp_path / "c.jsonl", PROMPTS[:1], SETTINGS, Dist())
        assert len(records) == 1 and flaky.calls["completions"] == 3
    finally:
        flaky.stop()


def test_persistent_errors_and_bad_requests_fail_clearly(tmp_path):
    broken = StubServer(fail_first=100).start()
    bad = StubServer(fail_first=100, status=400).start()
    try:
        with pytest.raises(CompletionsError, match="after 2 attempts.*HTTP 500"):
            obtain(server_cfg(broken.url, retries=2), tmp_path / "a.jsonl", PROMPTS[:1], SETTINGS, Dist())
        with pytest.raises(CompletionsError, match="refused prompt p0 \\(HTTP 400\\)"):
            obtain(server_cfg(bad.url), tmp_path / "b.jsonl", PROMPTS[:1], SETTINGS, Dist())
        assert bad.calls["completions"] == 1  # a 400 is not retried
    finally:
        broken.stop()
        bad.stop()


def test_slow_server_times_out_then_fails(tmp_path):
    slow = StubServer(delay_s=2.0).start()
    try:
        with pytest.raises(CompletionsError, match="after 2 attempts"):
            obtain(server_cfg(slow.url, retries=2, request_timeout_s=0.3), tmp_path / "a.jsonl", PROMPTS[:1],
                   SETTINGS, Dist())
    finally:
        slow.stop()


def test_changed_settings_are_refused(tmp_path, server):
    path = tmp_path / "c.jsonl"
    obtain(server_cfg(server.url), path, PROMPTS[:1], SETTINGS, Dist())
    with pytest.raises(CompletionsError, match="max_new_tokens: stored 8, now 16"):
        obtain(server_cfg(server.url), path, PROMPTS, {**SETTINGS, "max_new_tokens": 16}, Dist())


def test_processes_generate_disjoint_shares_and_merge(tmp_path, server):
    path = tmp_path / "c.jsonl"
    cfg = server_cfg(server.url)
    obtain(cfg, path, PROMPTS, SETTINGS, Dist(rank=1, world=2))  # rank 1 first: writes its part file only
    assert server.calls["completions"] == 2 and not path.exists()
    records = obtain(cfg, path, PROMPTS, SETTINGS, Dist(rank=0, world=2))
    assert server.calls["completions"] == 5 and sorted(records) == [p for p, _ in PROMPTS]
    assert not list(tmp_path.glob("c.jsonl.part-*")) and len(read_store(path)) == 5


def test_hf_source_stops_on_end_of_turn(tmp_path, tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    cfg = CompletionsConfig(source="hf", max_new_tokens=12, batch_size=3)
    records = obtain(cfg, tmp_path / "c.jsonl", PROMPTS[:3], SETTINGS, Dist(), target=target)
    for rec in records.values():
        ids = completion_ids(rec, target.tokenizer)
        assert 1 <= len(ids) <= 12
        assert rec["finish_reason"] == ("stop" if ids[-1] in target.stop_token_ids() else "length")


def test_hf_batches_hold_prompts_of_about_one_length_and_each_answer_keeps_its_id(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dflash.data import completions

    batches = []

    def fake_generate(target, texts, cfg, stop_ids):
        batches.append(texts)
        return [{"completion_ids": [len(t)], "finish_reason": "stop", "completion": t.upper()} for t in texts]

    monkeypatch.setattr(completions, "generate_hf", fake_generate)
    target = SimpleNamespace(tokenizer=lambda texts, add_special_tokens: {"input_ids": [t.split() for t in texts]},
                             stop_token_ids=lambda: [0])
    prompts = [(f"p{i}", " ".join(["w"] * n)) for i, n in enumerate([3, 9, 1, 7, 3, 12, 5])]
    records = obtain(CompletionsConfig(source="hf", batch_size=3), tmp_path / "c.jsonl", prompts, SETTINGS, Dist(),
                     target=target)
    assert [[len(t.split()) for t in b] for b in batches] == [[12, 9, 7], [5, 3, 3], [1]]
    assert {pid: r["completion"] for pid, r in records.items()} == {pid: text.upper() for pid, text in prompts}


class Tok:
    """A stand-in tokenizer: one id per character."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("choice,stop,labelled_end", [
    ({"stop_reason": None}, [], 99),                    # vLLM: stopped on the end-of-turn token
    ({"matched_stop": 99}, [], 99),                      # SGLang: the same
    ({"stop_reason": "###"}, ["###"], None),             # a user stop string: not part of the response
    ({"stop_reason": 42}, [], 42),                       # another stop token: that one is the label
    ({}, ["###"], None),                                 # the server does not say, and a stop string could have
    ({}, [], 99),                                        # the server does not say, and only end tokens stop it
    ({"finish_reason": "length", "stop_reason": None}, [], None),
])
def test_the_token_that_ended_generation_is_labelled_only_when_it_belongs_to_the_response(
        tmp_path, choice, stop, labelled_end):
    stub = StubServer(choice=choice).start()
    try:
        records = obtain(server_cfg(stub.url, stop=stop), tmp_path / "c.jsonl", PROMPTS[:1], SETTINGS, Dist(),
                         model="m", eos_id=99)
    finally:
        stub.stop()
    rec = records["p0"]
    ids = completion_ids(rec, Tok())
    text = [ord(c) for c in rec["completion"]]
    assert ids == text + ([labelled_end] if labelled_end is not None else [])
    assert rec["ids_from"] == "retokenized" and stub.payloads[0]["return_token_ids"] is True


def test_a_stop_string_the_server_cut_off_is_put_back_where_generation_stopped():
    """Servers leave the stop string out of the text; generate and live decoding stop at the token that completes
    it (dflash.data.stops), so the re-tokenized completion keeps it. Ids from the server are as generated."""
    rec = server_record({"text": "a = 1", "finish_reason": "stop", "stop_reason": "\n\n"}, ["\n\n"], 99)
    assert rec["completion"] == "a = 1\n\n" and rec["end_id"] is None
    assert server_record({"text": "a = 1", "finish_reason": "length"}, ["\n\n"], 99)["completion"] == "a = 1"
    ids = server_record({"text": "a", "finish_reason": "stop", "stop_reason": "##", "token_ids": [5, 6]}, ["##"], 9)
    assert ids["completion"] == "a" and ids["completion_ids"] == [5, 6]


def test_token_ids_from_the_server_are_used_as_generated(tmp_path):
    stub = StubServer(choice={"token_ids": [7, 8, 99], "stop_reason": None}).start()
    try:
        records = obtain(server_cfg(stub.url), tmp_path / "c.jsonl", PROMPTS[:1], SETTINGS, Dist(), model="m",
                         eos_id=99)
    finally:
        stub.stop()
    assert completion_ids(records["p0"], Tok()) == [7, 8, 99]  # not re-tokenized, the end token once
    assert records["p0"]["ids_from"] == "server"


def test_servers_that_refuse_token_ids_can_be_told_not_to_ask(tmp_path, server):
    obtain(server_cfg(server.url, token_ids=False), tmp_path / "c.jsonl", PROMPTS[:1], SETTINGS, Dist(), model="m")
    assert "return_token_ids" not in server.payloads[0]


@pytest.mark.slow
def test_batched_hf_completions_of_the_toy_target_equal_one_prompt_at_a_time(tmp_path):
    """The default run generates its training and held-out completions 64 prompts a batch, left-padded: the
    labels must still be the target's own greedy tokens, i.e. what it writes for each prompt alone (Gated DeltaNet
    layers included, whose states a padding token must not reach)."""
    from dflash.config.model import TargetConfig
    from dflash.data.prompts import load_prompts, prompt_text
    from dflash.target import toy
    from dflash.target.loading import load_target

    target = load_target(TargetConfig(name="toy", path=str(toy.SHIPPED), num_layers=12, mask_token_id=5,
                                      dtype="float32"))
    prompts = [(p.id, prompt_text(target.tokenizer, p, True, False)) for p in load_prompts("toy:stdlib")[:12]]
    lengths = {len(target.tokenizer(text)["input_ids"]) for _, text in prompts}
    assert len(lengths) > 6  # so the batch really is padded, by different amounts
    out = {}
    for batch in (1, 12):
        cfg = CompletionsConfig(source="hf", max_new_tokens=48, batch_size=batch)
        out[batch] = obtain(cfg, tmp_path / f"b{batch}.jsonl", prompts, SETTINGS, Dist(), target=target)
    assert {k: r["completion_ids"] for k, r in out[12].items()} == {k: r["completion_ids"] for k, r in out[1].items()}
    assert any(r["finish_reason"] == "stop" for r in out[1].values())  # some end their turn inside the 48 tokens


class ScriptedModel:
    """A stand-in for a target's `generate`: each prompt has a scripted greedy continuation, and rows finish
    exactly as transformers finishes them (an eos id or a stopping criterion), a finished row padded with
    `pad_token_id` while the others go on."""

    def __init__(self, tok, scripts: dict[str, str]):
        self.tok, self.scripts = tok, {p: tok(s, add_special_tokens=False)["input_ids"] for p, s in scripts.items()}

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, stopping_criteria=(),
                 stop_strings=None, tokenizer=None, **_):
        import torch
        from transformers import StopStringCriteria

        if stop_strings:  # generate's other way of being given stop strings
            stopping_criteria = [*stopping_criteria, StopStringCriteria(tokenizer, stop_strings)]
        script = [self.scripts[self.tok.decode(row, skip_special_tokens=True)] for row in input_ids.tolist()]
        seq, live = input_ids, torch.ones(len(script), dtype=torch.bool)
        for k in range(max_new_tokens):
            nxt = torch.where(live, torch.tensor([s[min(k, len(s) - 1)] for s in script]), pad_token_id)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            live &= ~torch.isin(nxt, torch.tensor(eos_token_id))
            for criterion in stopping_criteria:
                live &= ~criterion(seq, None)
            if not live.any():
                break
        return seq


@pytest.mark.parametrize("pad", ["<|endoftext|>", "<|mask|>"])  # a pad that is a stop id, and one that is not
def test_hf_rows_stopped_by_a_stop_string_end_there_in_a_batch_as_alone(pad):
    """generate pads a finished row while the batch goes on: those pads are not the target's tokens, whether or
    not the pad id is also a stop id, and a stop string's stop is a stop, as a server reports it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from dflash.data.completions import generate_hf
    from dflash.target import toy

    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    tok.pad_token = pad
    end = tok.convert_tokens_to_ids("<|im_end|>")
    scripts = {"first prompt": "x = 1\n    return x\n", "second prompt": "y = 2<|im_end|>",
               "third prompt": "z = [1, 2, 3, 4, 5, 6, 7, 8, 9]"}
    target = SimpleNamespace(tokenizer=tok, device="cpu", model=ScriptedModel(tok, scripts))
    cfg = CompletionsConfig(source="hf", max_new_tokens=12, stop=["return"])
    stop_ids = [tok.convert_tokens_to_ids("<|endoftext|>"), end]
    alone = [generate_hf(target, [p], cfg, stop_ids)[0] for p in scripts]
    together = generate_hf(target, list(scripts), cfg, stop_ids)
    assert together == alone
    first, second, third = together
    assert first["completion"] == "x = 1\n    return" and (first["finish_reason"], first["stop_reason"]) == (
        "stop", "return")
    assert first["completion_ids"] == tok("x = 1\n    return", add_special_tokens=False)["input_ids"]
    assert second["completion_ids"][-1] == end and (second["finish_reason"], second["stop_reason"]) == ("stop", end)
    assert len(third["completion_ids"]) == 12 and third["finish_reason"] == "length"


@pytest.mark.slow
def test_hf_completions_of_the_toy_target_with_a_stop_string_equal_one_prompt_at_a_time(tmp_path):
    """The reported case: the shipped toy target, stop=["return"], batch 2; the row that stops on the string first
    must not gain the pad id (<|endoftext|>, a stop id) as an end-of-turn the target never wrote."""
    from dflash.config.model import TargetConfig
    from dflash.data.prompts import load_prompts, prompt_text
    from dflash.target import toy
    from dflash.target.loading import load_target

    target = load_target(TargetConfig(name="toy", path=str(toy.SHIPPED), num_layers=12, mask_token_id=5,
                                      dtype="float32"))
    prompts = [(p.id, prompt_text(target.tokenizer, p, True, False)) for p in load_prompts("toy:stdlib")[:2]]
    out = {}
    for batch in (1, 2):
        cfg = CompletionsConfig(source="hf", max_new_tokens=24, batch_size=batch, stop=["return"])
        out[batch] = obtain(cfg, tmp_path / f"b{batch}.jsonl", prompts, SETTINGS, Dist(), target=target)
    assert out[2] == out[1]
    stopped = [r for r in out[2].values() if r["stop_reason"] == "return"]
    assert stopped and all(r["finish_reason"] == "stop" and r["completion"].endswith("return") for r in stopped)
    assert all(target.tokenizer.pad_token_id not in r["completion_ids"] for r in out[2].values())


def test_sampled_hf_completions_are_not_cut_to_generates_default_top_k(tmp_path, tiny_targets):
    """data.completions.temperature > 0 samples from the whole distribution: transformers' generate would
    otherwise apply its default top_k of 50. The tiny target's distribution is nearly flat over the Qwen
    vocabulary, so 24 sampled tokens all inside their step's top 50 would be a near-certain sign of the cut."""
    target = tiny_targets["tiny_qwen3"]
    cfg = CompletionsConfig(source="hf", max_new_tokens=24, batch_size=1, temperature=1.0, seed=3)
    records = obtain(cfg, tmp_path / "c.jsonl", PROMPTS[:1], SETTINGS, Dist(), target=target)
    ids = completion_ids(next(iter(records.values())), target.tokenizer)
    prompt = target.tokenizer(PROMPTS[0][1], add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = target.model(torch.cat([prompt, torch.tensor([ids])], 1)).logits[0, prompt.shape[1] - 1: -1]
    ranks = (logits > logits.gather(-1, torch.tensor(ids)[:, None])).sum(-1)
    assert len(ids) == 24 and int(ranks.max()) >= 50
    again = obtain(cfg, tmp_path / "d.jsonl", PROMPTS[:1], SETTINGS, Dist(), target=target)
    assert completion_ids(next(iter(again.values())), target.tokenizer) == ids  # seeded: the same draws
