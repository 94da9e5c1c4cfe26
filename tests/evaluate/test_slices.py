"""Evaluation by slice (eval.slices): tau per source, thinking switch, tool turns and context length."""

import pytest

from dflash.evaluate.slices import length_bucket, slice_metrics, slicers
from tests.conftest import compose

MIXTURE = ("data.sources=[{prompts: builtin:tiny_prompts, enable_thinking: true, name: think}, "
           "{prompts: builtin:tiny_prompts, enable_thinking: false, name: plain}]")


def test_each_block_goes_to_its_slice_and_each_slice_gets_the_walks_tau():
    """Blocks of two prompts in two views (thinking on: 'think/', off: 'plain/'), one at a long context: per slice
    the walk's tokens over blocks, the mean over prompts, blocks and prompts."""
    job = compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", MIXTURE, "eval.slices=[source,thinking,tools,length]"])
    of = slicers(job)
    steps = [({"prompt_id": "think/a", "anchor": 10}, 3), ({"prompt_id": "think/a", "anchor": 13}, 1),
             ({"prompt_id": "plain/a", "anchor": 10, "tools": True}, 2), ({"prompt_id": "plain/b", "anchor": 5000}, 4)]
    m = slice_metrics(steps, of, "eval")
    assert (m["eval/slice/thinking/on/tau"], m["eval/slice/thinking/on/blocks"]) == (2.0, 2)
    assert (m["eval/slice/thinking/off/tau"], m["eval/slice/thinking/off/tau_macro"]) == (3.0, 3.0)
    assert m["eval/slice/source/plain/prompts"] == 2 and m["eval/slice/tools/tools/tau"] == 2.0
    assert m["eval/slice/length/2-8k/tau"] == 4.0 and m["eval/slice/length/0-2k/blocks"] == 3
    plain = compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", "eval.slices=[source,thinking]"])
    m = slice_metrics([({"prompt_id": "a", "anchor": 0}, 2)], slicers(plain), "eval/live")
    assert m["eval/live/slice/source/all/tau"] == 2.0 and "eval/live/slice/thinking/off/tau" in m  # data=tiny: off
    assert [length_bucket(n) for n in (0, 2047, 2048, 8191, 8192, 40000)] == ["0-2k", "0-2k", "2-8k", "2-8k",
                                                                             "8-32k", "32k+"]
    assert slicers(compose("evaluate", ["target=tiny_qwen3_5", "data=tiny"])) == {}


def test_an_unknown_slice_is_refused():
    with pytest.raises(Exception, match=r"eval.slices\[\*\]"):
        compose("evaluate", ["target=tiny_qwen3_5", "data=tiny", "eval.slices=[thinkng]"])
