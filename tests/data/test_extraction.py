import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash.data.cache import FeatureCache
from dflash.data.extraction import extract_training
from dflash.dist import Dist
from dflash.errors import ProvenanceError
from dflash.provenance import check_provenance
from dflash.target.features import target_forward
from tests.conftest import REPO, compose

MANIFEST_FIELDS = {"target", "target_path", "tokenizer", "layer_ids", "dtype", "storage", "kernel_backend", "kernels",
                   "versions", "device", "data", "max_length", "created", "shards", "complete"}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_targets):
    root = tmp_path_factory.mktemp("extract")
    job = compose("extract", ["target=tiny_qwen3_5", "data=tiny", "data.completions.max_new_tokens=24",
                              f"features.dir={root}/features", "features.shard_sequences=5",
                              "features.storage=float32", "features.batch_tokens=300"])
    manifest = extract_training(job, tiny_targets["tiny_qwen3_5"], Dist())
    return job, manifest, tiny_targets["tiny_qwen3_5"]


def test_manifest_records_provenance(extracted):
    job, manifest, target = extracted
    assert MANIFEST_FIELDS <= set(manifest) and manifest["complete"]
    assert manifest["layer_ids"] == [1, 2, 3, 4, 5] and manifest["dtype"] == "float32"
    assert "linear_attention=torch_fallback" in manifest["kernel_backend"]
    assert manifest["target"]["weights_fingerprint"] == target.fingerprint != "unknown"
    assert manifest["data"]["num_sequences"] == 16 and len(manifest["shards"]) == 4
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])


def test_cached_features_equal_the_target_forward(extracted):
    job, manifest, target = extracted
    cache = FeatureCache(job.features.dir, dtype=torch.float32)
    for i in (0, 7, 15):
        ids, mask, feats = cache[i]
        ref = target_forward(target, ids[None], manifest["layer_ids"]).features[0]
        assert (feats - ref).abs().max() < 1e-5  # padded batches vs one sequence: same up to float noise
        assert mask.any() and not mask[0] and mask[-1]


def test_prompts_longer_than_max_length_are_skipped_and_counted(tmp_path, tiny_targets):
    job = compose("extract", ["target=tiny_qwen3", "data=tiny", "data.max_length=60", "data.limit=6",
                              "data.completions.max_new_tokens=8", f"features.dir={tmp_path}/f"])
    manifest = extract_training(job, tiny_targets["tiny_qwen3"], Dist())
    skipped = manifest["data"]["skipped"]["prompt_too_long"]
    assert skipped > 0 and manifest["data"]["num_sequences"] == 6 - skipped


def test_other_backend_is_refused_with_field_values_and_override(extracted):
    _, manifest, _ = extracted
    other = {**manifest, "kernel_backend": "causal_conv1d=causal_conv1d,full_attention=sdpa,linear_attention=fla"}
    with pytest.raises(ProvenanceError) as e:
        check_provenance(other, manifest, expected_name="the checkpoint")
    text = str(e.value)
    assert "kernel_backend" in text and "linear_attention=fla" in text and "linear_attention=torch_fallback" in text
    assert "provenance.allow_mismatch=[kernel_backend]" in text
    assert check_provenance(other, manifest, ["kernel_backend"]) == ["kernel_backend"]


def run_extract(cwd, *overrides, env=None):
    return subprocess.Popen([sys.executable, str(REPO / "extract.py"), *overrides], cwd=cwd,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_killed_extraction_resumes_to_an_identical_cache(tmp_path, dflash_home):
    common = ["target=tiny_qwen3_5", "data=tiny", "data.completions.max_new_tokens=24", "features.shard_sequences=2",
              f"data.completions.path={tmp_path}/completions.jsonl"]
    assert run_extract(tmp_path, *common, f"features.dir={tmp_path}/ref").wait(300) == 0
    proc = run_extract(tmp_path, *common, f"features.dir={tmp_path}/killed")
    deadline = time.time() + 300
    while not (tmp_path / "killed" / "shard-00002.json").exists():
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "shard-00007.json").exists()
    resumed = run_extract(tmp_path, *common, f"features.dir={tmp_path}/killed")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "already written; resuming" in out
    ref = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    got = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert [s["sha256"] for s in ref["shards"]] == [s["sha256"] for s in got["shards"]]
    for f in ("target", "tokenizer", "layer_ids", "kernel_backend", "data", "storage"):
        assert ref[f] == got[f]


def test_a_cache_just_extracted_is_not_hashed_again(extracted, monkeypatch):
    """The writers' digests are stamped (issue 27): training right after extraction hashes no shard."""
    from dflash.data import cache as fcache

    job, manifest, _ = extracted
    hashed = []
    monkeypatch.setattr(fcache, "file_sha256", lambda path: hashed.append(path.name))
    cache = FeatureCache(job.features.dir, dtype=torch.float32)
    cache.verify_all()
    assert hashed == [] and cache.hashed_bytes == 0 and len(manifest["shards"]) == 4
