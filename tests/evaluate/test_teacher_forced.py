"""Teacher-forced evaluation on the compiled flex path: bounded graphs, the dense path's numbers."""

import pytest
import torch

from dflash.config import DrafterConfig, EvalConfig, LayersConfig
from dflash.drafter.attention import flex_compile_count
from dflash.drafter.build import build_drafter
from dflash.evaluate.teacher_forced import ANCHORS_PER_FORWARD, teacher_forced
from dflash.tiling import FLEX_LENGTH_MULTIPLE


class SyntheticSet:
    """Held-out sequences of the given lengths: a 20-token prompt, random tokens and features."""

    def __init__(self, lengths, width, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = [f"p{i}" for i in range(len(lengths))]
        self.rows = []
        for n in lengths:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[20:] = True
            self.rows.append((torch.randint(0, vocab, (n,), generator=g), mask, torch.randn(n, width, generator=g)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.slow
def test_compiled_flex_evaluation_makes_one_graph_per_length_bucket_and_equals_the_dense_path(tiny_targets):
    """Lengths 100, 300 and 280 fall in two buckets of FLEX_LENGTH_MULTIPLE; their anchors make chunks of 80,
    256 + 24 and 256 + 4 blocks, which padded to a power of two each (the old rule) would compile 5 graphs."""
    import torch._dynamo

    target = tiny_targets["tiny_qwen3"]
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(ids=[1, 3]), target)
    data = SyntheticSet([100, 300, 280], 2 * target.config.hidden_size, target.config.vocab_size)
    cfg = EvalConfig(prompts="synthetic", ddtree_budgets=[4])
    assert ANCHORS_PER_FORWARD == 256 and FLEX_LENGTH_MULTIPLE == 256
    dense = teacher_forced(drafter, target.embed_tokens, target.lm_head, data, cfg, backend="sdpa")
    before, graphs = flex_compile_count(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    flex = teacher_forced(drafter, target.embed_tokens, target.lm_head, data, cfg, backend="flex")
    assert flex_compile_count() - before <= 2  # one per length bucket (one mask kind)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2
    assert [(r["prompt_id"], r["anchor"]) for r in flex] == [(r["prompt_id"], r["anchor"]) for r in dense]
    assert all(a["topk_ids"] == b["topk_ids"] for a, b in zip(flex, dense))
    diff = max(abs(x - y) for a, b in zip(flex, dense) for u, v in zip(a["topk_logprobs"], b["topk_logprobs"])
               for x, y in zip(u, v))
    assert diff < 1e-4
