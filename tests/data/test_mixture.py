"""Training mixtures (data.sources): each source its own prompts, rendering, sampling and weight."""

import json
from collections import Counter
from pathlib import Path

import pytest

from dflash.data.mixture import item_id, shares, source_of, source_store, sources_of, views
from dflash.errors import ConfigError
from dflash.train.batches import Schedule
from tests.conftest import compose

THINKING = ("data.sources=[{prompts: builtin:tiny_prompts, weight: 0.6, enable_thinking: true, name: think}, "
            "{prompts: builtin:tiny_prompts, weight: 0.4, enable_thinking: false, name: plain, "
            "completions: {temperature: 0.7, seed: 3}}]")


def test_one_source_is_data_itself_and_a_mixture_applies_each_sources_keys():
    job = compose("train", ["target=tiny_qwen3_5", "data=tiny"])
    (only,) = sources_of(job.data)
    assert only.name == "" and only.data is job.data and item_id(only, "p1") == "p1"
    assert shares(job.data, ["a", "b"]) is None and views(job.data) == [("", only)]
    job = compose("train", ["target=tiny_qwen3_5", "data=tiny", THINKING])
    think, plain = sources_of(job.data)
    assert (think.name, think.weight, think.data.enable_thinking) == ("think", 0.6, True)
    assert (plain.data.enable_thinking, plain.data.completions.temperature, plain.data.completions.seed) == (False, 0.7, 3)
    assert plain.data.completions.max_new_tokens == job.data.completions.max_new_tokens == 48  # data=tiny's, kept
    assert item_id(think, "p1") == "think/p1" and source_of("think/p1") == "think" and source_of("p1") == ""
    assert source_store(Path("/c/completions.jsonl"), plain).name == "completions.plain.jsonl"
    assert [name for name, _ in views(job.data)] == ["think", "plain"]  # two renderings (thinking on, off)
    same = compose("train", ["target=tiny_qwen3_5", "data=tiny", "data.sources=[{prompts: builtin:tiny_prompts}, "
                             "{prompts: builtin:tiny_prompts, completions: {temperature: 0.7}}]"])
    assert [name for name, _ in views(same.data)] == ["source0+source1"]  # rendered alike: one held-out view


@pytest.mark.parametrize("sources,match", [
    ("[{prompts: p, weight: 0}]", r"data.sources\[\?\].weight=0.*must be > 0"),
    ("[{prompts: p, name: a}, {prompts: q, name: a}]", r"data.sources: the name 'a' is given to two sources"),
    ("[{prompts: p, name: source1}, {prompts: q}]", r"data.sources: the name 'source1' is given to two sources"),
    ("[{prompts: p, wieght: 1}]", r"wieght"),
    ("[{prompts: p, name: 'a b'}]", r"name='a b'.*letters, digits"),
])
def test_a_bad_source_is_refused_naming_it(sources, match):
    with pytest.raises(Exception, match=match):
        compose("train", ["target=tiny_qwen3_5", "data=tiny", f"data.sources={sources}"])


def test_an_epoch_holds_each_source_at_its_share_cycling_through_its_sequences():
    """A source of 6 sequences at 30% and one of 4 at 70% of 10: 3 and 7 an epoch, each drawn from an endless
    cycle over its sequences, so over whole cycles every sequence of a source comes equally often (the 30% source
    shows each of its 6 once every two epochs); seeded, so every process and a resumed run see the same epochs."""
    groups = [(list(range(6)), 0.3), (list(range(6, 10)), 0.7)]
    schedule = Schedule(10, 2, 1, 1, 0, groups)
    assert schedule.quotas() == [3, 7]
    seen = Counter()
    for epoch in range(4):
        perm = schedule.permutation(epoch)
        assert len(perm) == 10 and sum(i < 6 for i in perm) == 3
        seen.update(perm)
        assert perm == Schedule(10, 2, 1, 1, 0, groups).permutation(epoch)
    assert {seen[i] for i in range(6)} == {2} and {seen[i] for i in range(6, 10)} == {7}  # 12 and 28 draws
    assert Schedule(7, 1, 1, 1, 0, [([0, 1, 2], 0.5), ([3, 4, 5, 6], 0.5)]).quotas() in ([4, 3], [3, 4])


@pytest.mark.slow
def test_a_two_source_mixture_trains_and_its_cache_is_checked_source_by_source(tiny_targets, tmp_path, monkeypatch):
    """The issue's command: thinking on (60%) and off (40%) of one prompt set trains; each source's completions in a
    store of its own, ids <source>/<prompt>, the manifest listing both with their settings, the held-out set one
    item per prompt and rendering, evaluated by slice (thinking on and off, 10 prompts each); a restart with other
    weights reuses the cache, one with a source changed is refused naming it."""
    from dflash.errors import CacheError
    from dflash.train.loop import train

    monkeypatch.chdir(tmp_path)
    # held-out answers of 32 tokens, not eval's 256: what is checked is which items and slices, not their length
    overrides = ["target=tiny_qwen3_5", "data=tiny", THINKING, "train.max_steps=4", "train.save_every=100",
                 "eval.ddtree_budgets=[4]", "eval.max_new_tokens=32", "logger=none", f"run.root={tmp_path}/runs",
                 "eval.slices=[thinking]"]
    train(compose("train", [*overrides, "run.name=a"]))
    summary = json.loads((tmp_path / "runs/a/eval/step-000004/summary.json").read_text())["metrics"]
    assert summary["eval/slice/thinking/on/prompts"] == summary["eval/slice/thinking/off/prompts"] == 10
    cache = tmp_path / "cache/tiny_qwen3_5/tiny"
    assert (cache / "completions.think.jsonl").exists() and (cache / "completions.plain.jsonl").exists()
    manifest = json.loads((cache / "features/manifest.json").read_text())
    listed = manifest["data"]["sources"]
    assert [(s["name"], s["weight"], s["enable_thinking"]) for s in listed] == [("think", 0.6, True),
                                                                               ("plain", 0.4, False)]
    assert listed[1]["completions_sampling"]["temperature"] == 0.7 and listed[0]["num_sequences"] == 16
    assert manifest["data"]["num_sequences"] == sum(s["num_sequences"] for s in listed)
    ids = [i for shard in manifest["shards"] for i in shard["ids"]]
    assert {source_of(i) for i in ids} == {"think", "plain"}
    heldout = next(tmp_path.glob("cache/tiny_qwen3_5/eval-*/features-*"))
    assert {source_of(i) for s in json.loads((heldout / "manifest.json").read_text())["shards"]
            for i in s["ids"]} == {"think", "plain"}
    train(compose("train", [*overrides, "run.name=b", THINKING.replace("0.6", "0.9")]))  # weights: same cache
    flipped = THINKING.replace("enable_thinking: false", "enable_thinking: true")
    with pytest.raises(CacheError, match=r"another mixture than data.sources gives \(source plain: enable_thinking"):
        train(compose("train", [*overrides, "run.name=c", flipped]))
    assert json.loads((cache / "features/manifest.json").read_text())["data"]["sources"] == listed
