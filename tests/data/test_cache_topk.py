"""features.topk_logits: the target's top-k next-token distributions in the cache, keyed in its manifest."""

import pytest
import torch

from dflash.data import cache as fcache
from dflash.data.cache import FeatureCache
from dflash.errors import CacheError
from dflash.target.features import TopK, topk_of


def test_topk_of_keeps_the_k_largest_probabilities_and_the_rest_of_the_mass():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    t = topk_of(logits, 2)
    p = torch.softmax(logits, -1)
    assert t.ids.tolist() == [[0, 2]] and torch.allclose(t.logprobs.exp(), p[:, [0, 2]])
    assert torch.allclose(t.rest, p[:, [1, 3]].sum(-1))


def test_shards_store_and_return_each_sequences_topk(tmp_path):
    manifest = {"format_version": 1, "layer_ids": [0], "storage": "bfloat16", "topk_logits": 3}
    fcache.open_for_writing(tmp_path, manifest)
    g = torch.Generator().manual_seed(0)
    tops = [topk_of(torch.randn(n, 20, generator=g), 3) for n in (4, 6)]
    fcache.write_shard(tmp_path, 0, ["a", "b"], [torch.arange(4), torch.arange(6)], [torch.ones(4, dtype=torch.bool),
                       torch.ones(6, dtype=torch.bool)], [torch.ones(4, 8), torch.ones(6, 8)], "bfloat16", 1, topk=tops)
    fcache.finalize(tmp_path, 1)
    cache = FeatureCache(tmp_path)
    assert cache.topk_logits == 3
    for i, want in enumerate(tops):
        got = cache.topk(i)
        assert isinstance(got, TopK) and got.ids.dtype == torch.int64
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.ids, want.ids)
        assert torch.equal(got.rest, want.rest)


def test_a_cache_without_topk_returns_none(tmp_path):
    fcache.open_for_writing(tmp_path, {"format_version": 1, "layer_ids": [0], "storage": "bfloat16"})
    fcache.write_shard(tmp_path, 0, ["a"], [torch.arange(2)], [torch.ones(2, dtype=torch.bool)], [torch.ones(2, 8)],
                       "bfloat16", 1)
    fcache.finalize(tmp_path, 1)
    cache = FeatureCache(tmp_path)
    assert cache.topk_logits == 0 and cache.topk(0) is None


def test_resuming_an_extraction_with_another_topk_is_refused(tmp_path):
    fcache.open_for_writing(tmp_path, {"format_version": 1, "layer_ids": [1], "storage": "bfloat16"})
    with pytest.raises(CacheError, match=r"topk_logits: cache has null, this run has 8"):
        fcache.open_for_writing(tmp_path, {"format_version": 1, "layer_ids": [1], "storage": "bfloat16",
                                           "topk_logits": 8})
