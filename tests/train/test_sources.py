"""What training reads before step 0: the data check, read once and kept in the cache's stamp."""

import json
import os
import time

import pytest

from dflash.data.extraction import training_prompts
from dflash.data.prompts import prompts_hash
from dflash.data.stamp import Stamp
from dflash.errors import CacheError
from dflash.train import sources
from tests.conftest import compose, tiny_job


def write_prompts(path, n):
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))


def job_for(tmp_path, prompts, *overrides):
    return tiny_job("train", tmp_path, f"data.prompts={prompts}", *overrides)


def manifest_of(job):
    """The part of a cache's manifest the data check compares (as extraction records it)."""
    prompts = training_prompts(job.data)
    return {"max_length": job.data.max_length,
            "data": {"prompts": job.data.prompts, "num_prompts": len(prompts), "prompts_sha256": prompts_hash(prompts),
                     "chat_template": job.data.chat_template, "enable_thinking": job.data.enable_thinking}}


@pytest.fixture
def reads(monkeypatch):
    """How often the data check read the prompts."""
    count = {"n": 0}
    real = sources.training_prompts

    def counting(data):
        count["n"] += 1
        return real(data)

    monkeypatch.setattr(sources, "training_prompts", counting)
    return count


def test_the_prompts_are_read_once_and_a_changed_file_is_still_refused(tmp_path, reads):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3)
    job = job_for(tmp_path, prompts)
    manifest = manifest_of(job)
    root = tmp_path / "features"
    root.mkdir()
    sources.check_data(job.data, job.features, manifest, Stamp(root, 0))
    assert reads["n"] == 1
    for rank in (0, 1):  # a later start, on any process: nothing read
        sources.check_data(job.data, job.features, manifest, Stamp(root, rank))
    assert reads["n"] == 1
    sources.check_data(job.data, job.features, manifest)  # without a stamp: read, as before
    assert reads["n"] == 2
    # one prompt changed, size kept, even the mtime set back: read again, and refused
    before = prompts.stat()
    time.sleep(0.02)  # past the file system's timestamp granularity (a few ms)
    prompts.write_text(prompts.read_text().replace("question 1", "question 7"))
    os.utime(prompts, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CacheError, match="prompts_sha256.*Delete that folder"):
        sources.check_data(job.data, job.features, manifest, Stamp(root, 1))
    assert reads["n"] == 3
    with pytest.raises(CacheError, match="prompts_sha256"):  # and again at the next start, from the stamp
        sources.check_data(job.data, job.features, manifest, Stamp(root, 0))
    assert reads["n"] == 3
    write_prompts(prompts, 4)  # a prompt added
    with pytest.raises(CacheError, match="num_prompts: 3 there, 4 now"):
        sources.check_data(job.data, job.features, manifest, Stamp(root, 0))
    write_prompts(prompts, 3)  # back to what the cache was made of, and a setting that picks prompts changed
    sources.check_data(job.data, job.features, manifest, Stamp(root, 0))
    with pytest.raises(CacheError, match="num_prompts: 3 there, 2 now"):
        fewer = job_for(tmp_path, prompts, "data.limit=2")
        sources.check_data(fewer.data, fewer.features, manifest, Stamp(root, 0))
    assert reads["n"] == 6


def test_a_file_added_to_a_prompts_folder_is_seen(tmp_path, reads):
    folder = tmp_path / "prompts"
    folder.mkdir()
    write_prompts(folder / "a.jsonl", 2)
    job = job_for(tmp_path, folder)
    manifest = manifest_of(job)
    (tmp_path / "features").mkdir()
    stamp = lambda: Stamp(tmp_path / "features")
    sources.check_data(job.data, job.features, manifest, stamp())
    sources.check_data(job.data, job.features, manifest, stamp())
    assert reads["n"] == 1
    (folder / "b.jsonl").write_text(json.dumps({"id": "q", "prompt": "more"}) + "\n")
    with pytest.raises(CacheError, match="num_prompts: 2 there, 3 now"):
        sources.check_data(job.data, job.features, manifest, stamp())


def test_unreadable_prompts_still_warn(tmp_path, caplog):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    job = job_for(tmp_path, prompts)
    manifest = manifest_of(job)
    prompts.unlink()
    (tmp_path / "features").mkdir()
    with caplog.at_level("WARNING"):
        sources.check_data(job.data, job.features, manifest, Stamp(tmp_path / "features"))
    assert "could not read data.prompts" in caplog.text


def test_a_cache_made_keeping_truncated_answers_is_refused_for_dropping_them(tmp_path):
    """data.completions.truncated changes which sequences a cache holds: a cache that counted its truncated answers
    and kept them (the default) is refused for a run that drops them, and the other way; an older cache (no count
    recorded) is not refused for it."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3)
    job = job_for(tmp_path, prompts)
    kept = manifest_of(job)
    kept["data"]["truncated"] = 1
    sources.check_data(job.data, job.features, kept)
    dropping = job_for(tmp_path, prompts, "data.completions.truncated=drop")
    with pytest.raises(CacheError, match="truncated_kept: True there, False now"):
        sources.check_data(dropping.data, dropping.features, kept)
    dropped = {**kept, "data": {**kept["data"], "truncated_kept": False}}
    with pytest.raises(CacheError, match="truncated_kept: False there, True now"):
        sources.check_data(job.data, job.features, dropped)
    sources.check_data(dropping.data, dropping.features, manifest_of(job))  # older


def test_a_cache_of_tool_conversations_is_refused_for_another_data_tools_keep_results(tmp_path):
    """What a regenerated call that differs from the recorded one does is in the sequences: a cache made with the
    other setting is another data set. Caches without tool conversations do not record it and are not refused."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    job = job_for(tmp_path, prompts, "data.tools.keep_results=true")
    sources.check_data(job.data, job.features, manifest_of(job))
    manifest = manifest_of(job)
    manifest["data"]["tool_results_kept"] = False
    with pytest.raises(CacheError, match="tool_results_kept: False there, True now"):
        sources.check_data(job.data, job.features, manifest)


def test_a_mixture_cache_is_refused_for_another_data_tools_keep_results(tmp_path):
    """check_mixture compares a source's tool-result handling as check_data does: where the cache recorded it (the
    source had tool conversations), another data.tools.keep_results is another data set; a source that recorded
    none is not refused for it."""
    from dflash.data.mixture import sampling, sources_of

    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    job = job_for(tmp_path, prompts, "data.tools.keep_results=true", "data.regenerate=all_turns",
                  f"data.sources=[{{prompts: {prompts}, weight: 1, name: a}}, {{prompts: {prompts}, weight: 1, name: b}}]")
    listed = []
    for source in sources_of(job.data):
        data = source.data
        listed.append({"name": source.name, "prompts": data.prompts, "num_prompts": 2,
                       "prompts_sha256": prompts_hash(training_prompts(data)), "chat_template": data.chat_template,
                       "enable_thinking": data.enable_thinking, "chat_template_kwargs": dict(data.chat_template_kwargs),
                       "completions_sampling": sampling(source)})
    manifest = {"max_length": job.data.max_length, "data": {"sources": listed}}
    sources.check_data(job.data, job.features, manifest)  # nothing recorded about tool results: not refused
    listed[1]["tool_results_kept"] = True
    sources.check_data(job.data, job.features, manifest)
    listed[1]["tool_results_kept"] = False
    with pytest.raises(CacheError, match="source b: tool_results_kept: False there, True now"):
        sources.check_data(job.data, job.features, manifest)


def made_now(data) -> dict:
    """Every setting data.* makes its sequences with, keyed as a manifest records them (sequences.made_with)."""
    from dflash.data.sequences import made_with

    return made_with(chat_template=data.chat_template, enable_thinking=data.enable_thinking,
                     template_kwargs=data.chat_template_kwargs, regenerate=data.regenerate,
                     truncated=data.completions.truncated, keep_results=data.tools.keep_results)


def test_every_setting_a_set_can_record_is_compared_plain_and_in_a_mixture(tmp_path):
    """The settings prepare_sequences can write into a set's info are made_with's, all of them (a set with multi-turn
    and tool conversations that drops truncated answers writes every one): a cache that recorded any of them otherwise
    is refused by check_data and, for a source, by check_mixture, naming it. The keys come from made_with, so a
    setting added there is covered here; one the record lacks (a cache made before it) is not refused."""
    from dflash.data.mixture import sampling, sources_of
    from dflash.data.sequences import recorded

    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    job = job_for(tmp_path, prompts)
    written = recorded(made_now(job.data) | {"truncated_kept": False}, multi_turn=True, tools=True)
    assert set(written) == set(made_now(job.data))
    plain = manifest_of(job)
    plain["data"] |= {"truncated": 0, **made_now(job.data)}
    sources.check_data(job.data, job.features, plain)
    two = f"data.sources=[{{prompts: {prompts}, name: a}}, {{prompts: {prompts}, name: b}}]"
    mixed = job_for(tmp_path, prompts, two)
    listed = [{"name": s.name, "prompts": s.data.prompts, "num_prompts": 2,
               "prompts_sha256": plain["data"]["prompts_sha256"], "completions_sampling": sampling(s), "truncated": 0,
               **made_now(s.data)} for s in sources_of(mixed.data)]
    mixture = {"max_length": job.data.max_length, "data": {"sources": listed}}
    sources.check_data(mixed.data, mixed.features, mixture)
    for key in written:
        other = {**plain, "data": {**plain["data"], key: ["another", plain["data"][key]]}}
        with pytest.raises(CacheError, match=rf"other data than data.\* gives \({key}: \['another'"):
            sources.check_data(job.data, job.features, other)
        other = {**mixture, "data": {"sources": [listed[0], {**listed[1], key: ["another", listed[1][key]]}]}}
        refused = rf"another mixture than data.sources gives \(source b: {key}: \['another'"
        with pytest.raises(CacheError, match=refused):
            sources.check_data(mixed.data, mixed.features, other)
    older = {k: v for k, v in plain["data"].items() if k not in written and k != "truncated"}
    sources.check_data(job.data, job.features, {**plain, "data": older})
    older = [{k: v for k, v in s.items() if k not in written and k != "truncated"} for s in listed]
    sources.check_data(mixed.data, mixed.features, {**mixture, "data": {"sources": older}})


def test_a_mixture_cache_made_regenerating_the_last_turn_is_refused_for_all_turns(tmp_path, tiny_targets):
    """Issue 65: a source's regenerate is another set of sequences (last_turn: one a conversation, all_turns: one a
    user turn). The record prepare_training writes for multi-turn prompts holds it; the same mixture is taken, one
    asking all_turns of that source is refused naming the source and regenerate."""
    from dflash.data.extraction import prepare_training
    from dflash.dist import Dist

    prompts = tmp_path / "talks.jsonl"
    prompts.write_text(json.dumps({"id": "c", "messages": [
        {"role": "user", "content": "write a loop"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "now in reverse"}, {"role": "assistant", "content": "done"}]}) + "\n"
        + json.dumps({"id": "o", "prompt": "one turn only"}) + "\n")
    mixture = "data.sources=[{{prompts: {p}, name: a, regenerate: {r}}}, {{prompts: {p}, name: b}}]"
    made = job_for(tmp_path, prompts, mixture.format(p=prompts, r="last_turn"), "data.completions.max_new_tokens=4")
    prepared = prepare_training(made, tiny_targets["tiny_qwen3"], Dist())
    assert [s["regenerate"] for s in prepared.info["sources"]] == ["last_turn", "all_turns"]
    manifest = {"max_length": made.data.max_length, "data": prepared.info}
    sources.check_data(made.data, made.features, manifest)
    asked = job_for(tmp_path, prompts, mixture.format(p=prompts, r="all_turns"), "data.completions.max_new_tokens=4")
    with pytest.raises(CacheError, match=r"source a: regenerate: 'last_turn' there, 'all_turns' now"):
        sources.check_data(asked.data, asked.features, manifest)


def test_a_bfloat16_cache_of_a_float32_target_made_before_auto_still_trains(tmp_path, tiny_targets, caplog):
    """A cache made under the former default (bfloat16 storage for the float32 tiny target, no storage_exact in its
    manifest) trains under features.storage=auto as it is, nothing extracted again, and training start says in one
    line that the drafter trains on rounded features."""
    import torch

    from dflash.data.extraction import extract_training
    from dflash.dist import Dist
    from dflash.io import read_json, write_json
    from dflash.train.loop import train

    root = tmp_path / "features"
    common = ["debug=tiny", "target=tiny_qwen3", "data.limit=3", "data.completions.max_new_tokens=8",
              f"features.dir={root}", "eval.max_prompts=1", "eval.max_new_tokens=8", "eval.at_start=false",
              f"run.root={tmp_path}/runs", "train.max_steps=2"]
    made = extract_training(compose("train", [*common, "features.storage=bfloat16"]), tiny_targets["tiny_qwen3"],
                            Dist())
    write_json(root / "manifest.json", {k: v for k, v in read_json(root / "manifest.json").items()
                                        if k != "storage_exact"})
    caplog.clear()  # extraction has said it; training start says it again
    with caplog.at_level("WARNING"):
        run = train(compose("train", [*common, "run.name=old-cache"]))  # features.storage left at auto
    lines = [r.getMessage() for r in caplog.records if "rounded features" in r.getMessage()]
    assert len(lines) == 1 and "float32 target's features are stored in bfloat16" in lines[0]
    assert read_json(root / "manifest.json")["shards"] == made["shards"]  # nothing extracted again
    losses = [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
