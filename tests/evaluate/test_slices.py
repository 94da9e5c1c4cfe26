"""Evaluation by slice (eval.slices): tau per source, thinking switch, tool turns and context length."""

import pytest

from dflash.evaluate.slices import length_bucket, slice_metrics, slicers
from tests.conftest import compose

MIXTURE = ("data.sources=[{prompts: builtin:tiny_prompts, enable_thinking: true, name: think}, "
           "{prompts: builtin:tiny_prompts, enable_thinking: false, name: plain}]")



def slicers_of(job):
    return slicers(job.data, job.eval)

def test_each_block_goes_to_its_slice_and_each_slice_gets_the_walks_tau():
    """Blocks of two prompts in two views (thinking on: 'think/', off: 'plain/'), one at a long context: per slice
    the walk's tokens over blocks, the mean over prompts, blocks and prompts."""
    job = compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", MIXTURE, "eval.slices=[source,thinking,tools,length]"])
    of = slicers(job.data, job.eval)
    steps = [({"prompt_id": "think/a", "anchor": 10}, 3), ({"prompt_id": "think/a", "anchor": 13}, 1),
             ({"prompt_id": "plain/a", "anchor": 10, "tools": True}, 2), ({"prompt_id": "plain/b", "anchor": 5000}, 4)]
    m = slice_metrics(steps, of, "eval")
    assert (m["eval/slice/thinking/on/tau"], m["eval/slice/thinking/on/blocks"]) == (2.0, 2)
    assert (m["eval/slice/thinking/off/tau"], m["eval/slice/thinking/off/tau_macro"]) == (3.0, 3.0)
    assert m["eval/slice/source/plain/prompts"] == 2 and m["eval/slice/tools/tools/tau"] == 2.0
    assert m["eval/slice/length/2-8k/tau"] == 4.0 and m["eval/slice/length/0-2k/blocks"] == 3
    plain = compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", "eval.slices=[source,thinking]"])
    m = slice_metrics([({"prompt_id": "a", "anchor": 0}, 2)], slicers(plain.data, plain.eval), "eval/live")
    assert m["eval/live/slice/source/all/tau"] == 2.0 and "eval/live/slice/thinking/off/tau" in m  # data=tiny: off
    assert [length_bucket(n) for n in (0, 2047, 2048, 8191, 8192, 40000)] == ["0-2k", "0-2k", "2-8k", "2-8k",
                                                                             "8-32k", "32k+"]
    assert slicers_of(compose("evaluate", ["target=tiny_qwen3_5", "data=tiny"])) == {}


def test_a_prompt_id_with_a_slash_is_its_own_id_without_a_mixture():
    """Benchmark ids hold a "/" (gsm8k/12, HumanEval/0): without data.sources no id has a view prefix, so every
    block is in the slice "all" and the data's thinking switch; in a mixture the view is the id's first part."""
    plain = slicers_of(compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", "eval.slices=[source,thinking]"]))
    steps = [({"prompt_id": "gsm8k/12", "anchor": 0}, 2), ({"prompt_id": "HumanEval/0", "anchor": 0}, 4)]
    m = slice_metrics(steps, plain, "eval")
    assert [k for k in m if k.endswith("/tau")] == ["eval/slice/source/all/tau", "eval/slice/thinking/off/tau"]
    assert m["eval/slice/source/all/prompts"] == 2
    mixed = slicers_of(compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", MIXTURE,
                                            "eval.slices=[source,thinking]"]))
    m = slice_metrics([({"prompt_id": "think/gsm8k/12", "anchor": 0}, 3)], mixed, "eval")
    assert m["eval/slice/source/think/tau"] == 3.0 and m["eval/slice/thinking/on/tau"] == 3.0


def test_an_unknown_slice_is_refused():
    with pytest.raises(Exception, match=r"eval.slices\[\*\]"):
        compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", "eval.slices=[thinkng]"])


def tool_job(tmp_path, *overrides, bad: bool = False):
    """tiny_qwen3_tools evaluated on two tool conversations (tests.data.test_tools: the target calls as recorded in
    one, another call in the other) and a text prompt (bad: and one whose call is not JSON), sliced by tool turns."""
    import json

    from tests.data.test_tools import record

    prompts = tmp_path / f"tools{'-bad' if bad else ''}.jsonl"
    records = [record("same", "Paris"), record("other", "Rome"), {"id": "text", "prompt": "hello"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records + [record("bad", "Oslo")] * bad))
    return compose("evaluate", ["debug=tiny", "target=tiny_qwen3_tools", f"eval.prompts={prompts}",
                                "eval.max_new_tokens=24", "eval.max_prompts=3", "eval.ddtree_budgets=[2]",
                                "eval.slices=[tools]",
                                f"features.dir={tmp_path}/cache/features", f"run.root={tmp_path}/runs", *overrides])


def test_the_heldout_sets_tool_turns_are_the_tools_slice_teacher_forced(tools_target, tmp_path, monkeypatch):
    """The held-out set's manifest lists its tool turns (a call, an answer to tool results); teacher-forced records
    of those carry tools: true, and the slice of each kind gets its own blocks."""
    import torch

    from dflash.config import DrafterConfig, LayersConfig
    from dflash.data import completions
    from dflash.dist import Dist
    from dflash.drafter.build import build_drafter
    from dflash.evaluate import heldout
    from dflash.evaluate.teacher_forced import summarize, teacher_forced
    from tests.data.test_tools import scripted

    job = tool_job(tmp_path)
    monkeypatch.setattr(completions, "generate_hf", scripted())
    heldout.prepare(job, tools_target, [1, 3], Dist())
    eval_set = heldout.load(job, tools_target, [1, 3])
    assert sorted(eval_set.ids) == ["other", "same", "same:turn2", "same:turn3", "text"]
    assert heldout.heldout_key(job.data, job.eval, tools_target)["tool_results_kept"] is False
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4), LayersConfig(ids=[1, 3]), tools_target)
    records = teacher_forced(drafter, tools_target.embed_tokens, tools_target.lm_head, eval_set, job.eval)
    assert {r["prompt_id"] for r in records if r.get("tools")} == {"same", "same:turn2", "other"}
    m = summarize(records, 4, [2], slices=slicers(job.data, job.eval))["metrics"]
    assert m["eval/slice/tools/tools/prompts"] == 3 and m["eval/slice/tools/text/prompts"] == 2
    # another set: the recorded result after another call; a bad record skipped
    kept = tool_job(tmp_path, "data.tools.keep_results=true", "data.skip_bad_records=true", "eval.max_prompts=4",
                    bad=True)
    heldout.prepare(kept, tools_target, [1, 3], Dist())
    kept_set = heldout.load(kept, tools_target, [1, 3])
    assert {"other:turn2", "other:turn3"} <= set(kept_set.ids) and not any(i.startswith("bad") for i in kept_set.ids)
    assert kept_set.manifest["data"]["skipped"]["bad_records"] == 1


def test_live_decoding_carries_tool_conversations_on_as_the_heldout_set_does(tools_target, tmp_path, monkeypatch):
    """Live decoding at each generation point, the recorded result after the chain's own call (the target's outputs
    scripted as in the held-out set): the requests of the held-out items, tool turns flagged, the conversation
    whose call differs ended after its first request."""
    import torch

    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter
    from dflash.drafter.decoding.engine import SpecResult
    from dflash.evaluate import live
    from tests.data.test_tools import scripted

    answer = scripted()
    seen = []

    def plain(target, ids, max_new_tokens, **kw):  # the scripted answer
        text = tools_target.tokenizer.decode(ids[0].tolist())
        seen.append(text)
        return torch.cat([ids, torch.tensor([answer(tools_target, [text], None, None)[0]["completion_ids"]])], 1)

    def speculative(drafter, target, ids, max_new_tokens, **kw):  # the same answer, one token a step
        out = plain(target, ids, max_new_tokens)
        n = out.shape[1] - ids.shape[1]
        return SpecResult(out, [1] * n, n + 1, n, [[]] * n)

    monkeypatch.setattr(live, "greedy_generate", plain)
    monkeypatch.setattr(live, "speculative_generate", speculative)
    job = tool_job(tmp_path, "eval=live", "eval.decode.warmup_tokens=0", "eval.ddtree_budgets=[]")
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=4), LayersConfig(ids=[1, 3]), tools_target)
    records, summary = live.live_eval(job.eval, job.data, drafter, tools_target)
    assert summary["metrics"]["eval/live_requests"] == 5
    assert sorted({r["prompt_id"] for r in records}) == ["other", "same", "same:turn2", "same:turn3", "text"]
    assert {r["prompt_id"] for r in records if r.get("tools")} == {"same", "same:turn2", "other"}
    # two decodings a request (plain, then speculative): the third is same:turn2's, after the recorded result
    assert "<tools>" in seen[0] and seen[2].endswith("<tool_response>\n20C\n</tool_response><|im_end|>\n"
                                                     "<|im_start|>assistant\n<think>\n\n</think>\n\n")
