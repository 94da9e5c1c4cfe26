"""The toy target's corpus, prompts and the shipped model's recorded behaviour."""

import json
import random

import pytest
import torch

from dflash.target import toy
from dflash.target.toy_measure import continuations


def test_splits_are_disjoint_and_prompts_come_from_library_code():
    splits = {s: set(toy.corpus_files(s, tests=True)) for s in ("pretrain", "validation", "prompts")}
    assert all(splits.values())
    assert not (splits["pretrain"] & splits["prompts"]) and not (splits["pretrain"] & splits["validation"])
    assert not (splits["prompts"] & splits["validation"])
    library = toy.corpus_files("prompts")
    assert library and not any({"test", "tests"} & set(p.parts) for p in library)


def test_a_rename_renames_the_name_everywhere_but_after_a_dot():
    text = ('def area(w, h):\n    """Area of a w x h box."""\n    if w < 0:\n        raise ValueError(w)\n'
            '    size = w * h\n    return self.w, size')
    seen = set()
    for seed in range(20):
        prompt, answer = toy.rename_task(text, random.Random(seed), ["width", "height", "size", "area"])
        old, new = prompt.split("`")[1], prompt.split("`")[3]
        assert prompt == f"Rename `{old}` to `{new}`:\n\n{text}" and new in ("width", "height")  # not a word of it
        seen.add(old)
        if old == "w":
            assert answer == ('def area(%s, h):\n    """Area of a %s x h box."""\n    if %s < 0:\n        raise '
                              'ValueError(%s)\n    size = %s * h\n    return self.w, size') % ((new,) * 5)
    assert seen == {"w", "h", "size"}  # arguments and local names
    assert toy.rename_task("def f(self):\n    return 1", random.Random(0), ["x"]) is None


def test_functions_keep_decorators_parse_alone_and_have_a_body(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('class A:\n    @property\n    def size(self):\n        """The size of the box."""\n        return len(self.items) + 1\n\n'
                   '    def only_doc(self):\n        """Nothing after me, so nothing to complete, which is skipped."""\n')
    (funcs,) = [toy.functions([src])]
    assert funcs == ['@property\ndef size(self):\n    """The size of the box."""\n    return len(self.items) + 1']


def test_training_and_held_out_prompts_never_overlap():
    train = toy.prompt_records("stdlib")
    held = toy.prompt_records("stdlib_eval")
    assert len(held) == toy.EVAL_RESERVE and len(train) > 1000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert toy.prompt_records("stdlib", limit=3) == train[:3]
    with pytest.raises(Exception, match="toy:stdlib_eval"):
        toy.prompt_records("nope")


def test_packed_rows_keep_labels_aligned_with_ids():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy.SHIPPED)
    examples = [toy.chat_example(tokenizer, f"Rename `a` to `b{i}`:\n\na = {i}", f"b{i} = {i}") for i in range(40)]
    rows = toy.pack_rows(tokenizer, examples, 64)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream = [t for ids, labels in examples for t in zip(ids + [eot], labels + [-100])]
    assert rows.shape == (len(stream) // 64, 2, 64)
    assert list(zip(rows[:, 0].flatten().tolist(), rows[:, 1].flatten().tolist())) == stream[: rows.shape[0] * 64]


def test_shipped_target_records_its_build():
    info = json.loads((toy.SHIPPED / "toy_info.json").read_text())
    held = info["held_out_continuations"]
    # what docs/results/2026-12-02-toy-target.md states for the shipped build (a rebuild that does worse should not
    # ship silently)
    assert held["ended_turn"] >= 0.9 and held["repeated_4gram_fraction"] <= 0.15 and held["lines_right"] >= 0.4
    assert info["held_out_loss"] < 1.0 and info["params"] == pytest.approx(3.4e6, rel=0.1)
    stages = [info]
    while "init" in stages[-1]:
        stages.append(stages[-1]["init"])
    assert stages[-1]["steps"] == 1200 and len(stages) == 6  # every stage of the shipped build, recorded
    # its layer 9 (the last of the layers a drafter reads by default) learned the tokens 2-4 ahead
    assert info["lookahead"] == {"offsets": [2, 3, 4], "layer": 9, "weight": 0.3}
    assert len(held["samples"]) == held["prompts"]


@pytest.mark.slow
def test_shipped_target_still_writes_its_recorded_continuations():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((toy.SHIPPED / "toy_info.json").read_text())["held_out_continuations"]
    tokenizer = AutoTokenizer.from_pretrained(toy.SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(toy.SHIPPED, dtype=torch.float32)
    samples = info["samples"][:3]
    again = continuations(model, tokenizer, [(s["prompt"], "") for s in samples], info["max_new_tokens"])
    # saved in bf16 after recording in float32: allow the odd late flip, not different text
    for s, a in zip(samples, again["samples"]):
        n = min(len(s["continuation"]), len(a["continuation"]), 200)
        assert a["continuation"][:n] == s["continuation"][:n]


def test_chat_examples_are_tokenized_as_the_pipeline_generates_them():
    """The prompt is tokenized on its own and the target generates the answer after it. Pretraining on the
    joined text instead merged the template's closing "\\n\\n" with the answer's indentation, so the model
    never saw an answer start right after the prompt's last token and began its answers unindented."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy.SHIPPED)
    prompt, answer = "def f(x):\n    \"\"\"Double x.\"\"\"", "    y = x * 2\n    return y"
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids, labels = toy.chat_example(tokenizer, prompt, answer)
    answer_ids = tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert ids == head_ids + answer_ids
    assert labels == [-100] * len(head_ids) + answer_ids  # the target learns to answer, not to write prompts
    joined = tokenizer(head + answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert joined[: len(head_ids)] != head_ids  # the hazard is real for this tokenizer
