"""Target loading, layer ids and kernel reports on the tiny presets."""

import os

import pytest
import torch

from dflash.config import DrafterConfig, LayersConfig
from dflash.drafter.build import build_drafter, check_fits
from dflash.errors import ConfigError
from dflash.target import build_target_layer_ids, load_target, resolve_layer_ids
from dflash.target.features import target_forward
from dflash.target.identity import kernel_backend
from tests.conftest import compose


@pytest.mark.parametrize("T,n,ids", [(36, 5, [1, 9, 17, 25, 33]), (64, 5, [1, 16, 31, 46, 61]),
                                     (8, 5, [1, 2, 3, 4, 5]), (28, 1, [14])])
def test_reference_layer_formula(T, n, ids):
    assert build_target_layer_ids(T, n) == ids


def test_layer_ids_out_of_range_are_named():
    with pytest.raises(ConfigError, match=r"\[40\].*outside \[0, 36\)"):
        resolve_layer_ids(LayersConfig(ids=[1, 40]), 36)


def test_last_layer_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="last layer.*allow_last_layer"):
        resolve_layer_ids(LayersConfig(ids=[1, 35]), 36)
    assert resolve_layer_ids(LayersConfig(ids=[1, 35], allow_last_layer=True), 36) == [1, 35]


def test_formula_that_repeats_layers_is_refused():
    with pytest.raises(ConfigError, match="repeated layer ids"):
        resolve_layer_ids(LayersConfig(num=5), 6)


def test_tiny_presets_load_through_from_pretrained(tiny_targets, dflash_home):
    q3, q35 = tiny_targets["tiny_qwen3"], tiny_targets["tiny_qwen3_5"]
    assert (dflash_home / "targets" / "tiny_qwen3" / "config.json").exists()
    assert q3.num_layers == q35.num_layers == 8 and q3.hidden_size == 64
    assert not q3.is_hybrid and q35.is_hybrid
    assert q35.layer_types.count("linear_attention") == 6
    assert q3.tokenizer.mask_token_id == q3.mask_token_id == 261
    assert isinstance(q3.embed_tokens, torch.nn.Embedding) and q3.lm_head.weight.shape == (q3.vocab_size, 64)


def test_kernel_report_names_the_fallback_on_cpu(tiny_targets):
    report = tiny_targets["tiny_qwen3_5"].kernels
    assert report["linear_attention"] == "torch_fallback" and report["causal_conv1d"] == "torch_fallback"
    assert report["full_attention"] == "sdpa"
    assert "linear_attention" not in tiny_targets["tiny_qwen3"].kernels
    assert kernel_backend(report).startswith("causal_conv1d=torch_fallback,")


def _dispatch(implementation, supported_devices):
    """A kernel-dispatching function as transformers wraps one (hub_kernels.use_kernel_func_from_hub_with_fallback):
    its closure holds the bound implementation and, from 5.25, the device types that implementation runs on."""
    def wrapped(*args, **kwargs):
        if supported_devices is not None and args[0].device.type not in supported_devices:
            return None
        return implementation(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("devices,expected", [(("cuda", "xpu", "mlu", "npu"), "torch_fallback"),
                                              (("cuda", "cpu"), "fla"), (None, "fla")])
def test_kernel_report_names_fla_only_where_transformers_runs_it(tiny_targets, monkeypatch, devices, expected):
    """transformers 5.25 binds fla when it is importable but runs its PyTorch reference for CPU inputs: a kernel
    report that named the bound package recorded fla for features the fallback computed."""
    import sys

    from dflash.target.identity import kernel_report

    model = tiny_targets["tiny_qwen3_5"].model
    module = sys.modules[type(next(m for m in model.modules() if "GatedDeltaNet" in type(m).__name__)).__module__]
    fla_kernel = lambda *a, **k: None  # noqa: E731
    fla_kernel.__module__ = "fla.ops.gated_delta_rule.chunk"
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _dispatch(fla_kernel, devices))
    report = kernel_report(model, tiny_targets["tiny_qwen3_5"].layer_types)
    assert report["linear_attention"] == expected and report["causal_conv1d"] == "torch_fallback"


def test_features_equal_output_hidden_states(tiny_target):
    ids = torch.randint(0, 256, (2, 23))
    layer_ids = [1, 4, 7]  # 7 is the last layer: HF reports it after the final norm
    out = target_forward(tiny_target, ids, layer_ids)
    with torch.no_grad():
        ref = tiny_target.model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(out.features, torch.cat([ref[i + 1] for i in layer_ids], -1))


def test_mask_token_outside_vocab_is_refused(dflash_home):
    cfg = compose("train", ["target=tiny_qwen3", "target.mask_token_id=5000"]).target
    with pytest.raises(ConfigError, match="mask_token_id=5000.*outside"):
        load_target(cfg, torch.device("cpu"))


def test_wrong_layer_count_is_refused(dflash_home):
    cfg = compose("train", ["target=tiny_qwen3", "target.num_layers=36"]).target
    with pytest.raises(ConfigError, match="num_layers=36"):
        load_target(cfg, torch.device("cpu"))


def test_missing_target_path_is_explained():
    cfg = compose("train", ["target=tiny_qwen3", "target.build=null", "target.path=/nonexistent/model"]).target
    with pytest.raises(FileNotFoundError, match="target.path"):
        load_target(cfg, torch.device("cpu"))


def test_drafter_sized_after_target(tiny_target):
    drafter = build_drafter(DrafterConfig(num_layers=2, block_size=8), LayersConfig(num=3), tiny_target)
    assert drafter.target_layer_ids == [1, 3, 5]
    assert drafter.fc.weight.shape == (64, 3 * 64) and drafter.mask_token_id == 261


def test_drafter_of_another_width_is_refused(tiny_targets):
    from transformers import Qwen3Config

    from dflash.drafter.build import drafter_config
    from dflash.drafter.model import DFlashDraftModel

    wide = Qwen3Config(vocab_size=262, hidden_size=96, intermediate_size=64, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2)
    drafter = DFlashDraftModel(drafter_config(wide, num_layers=1, block_size=4, target_layer_ids=[1],
                                           mask_token_id=261))
    with pytest.raises(ConfigError, match="hidden size 96 but the target has 64"):
        check_fits(drafter, tiny_targets["tiny_qwen3"])


def test_tokenizer_fingerprint_ignores_call_time_settings(tiny_targets):
    from dflash.target.identity import tokenizer_fingerprint

    tok = tiny_targets["tiny_qwen3"].tokenizer
    before = tokenizer_fingerprint(tok)
    side, tok.padding_side = tok.padding_side, "left"
    try:
        assert tokenizer_fingerprint(tok) == before
    finally:
        tok.padding_side = side


def test_composite_qwen3_5_checkpoint_loads_its_text_part(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (text + vision, as Qwen publishes them)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash.config import TargetConfig
    from dflash.target.builtin import tiny_qwen3_5_config
    from dflash.target.tokenizer import build_tokenizer

    tok = build_tokenizer()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=tiny_qwen3_5_config(len(tok)).to_dict(),
                                                         vision_config=vision)).eval()
    full.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = TargetConfig(name="composite", path=str(tmp_path), mask_token_id=261, dtype="float32")
    target = load_target(cfg, torch.device("cpu"))
    assert target.num_layers == 8 and target.is_hybrid and target.kernels["linear_attention"] == "torch_fallback"
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(full(input_ids=ids).logits, target.model(input_ids=ids).logits)
    heads = load_target(cfg, torch.device("cpu"), heads_only=True)
    assert heads.model is None and torch.equal(heads.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(heads.lm_head.weight, target.lm_head.weight)


def test_builtin_target_under_home_is_built_once(tmp_path, monkeypatch):
    """The preset path starts with ~; it must be expanded before checking whether it exists."""
    from dflash.config import TargetConfig
    from dflash.target import builtin as builtin_targets
    from dflash.target.builtin import ensure_built

    monkeypatch.setenv("HOME", str(tmp_path))
    calls = []
    real = builtin_targets.build
    monkeypatch.setattr(builtin_targets, "build", lambda name, dest: (calls.append(name), real(name, dest)))
    cfg = TargetConfig(name="t", path="~/.cache/dflash/targets/tiny_qwen3", build="tiny_qwen3", mask_token_id=261)
    ensure_built(cfg)
    ensure_built(cfg)
    assert calls == ["tiny_qwen3"] and (tmp_path / ".cache/dflash/targets/tiny_qwen3/config.json").exists()


def test_other_processes_wait_for_process_0_to_build_a_builtin_target(tmp_path, monkeypatch):
    """transformers' save_pretrained writes on rank 0 only: a rank-1 build used to rename a folder holding
    just the tokenizer into place. Other ranks now build nothing and wait for rank 0's folder."""
    import threading

    from dflash.config import TargetConfig
    from dflash.errors import NotFoundError
    from dflash.target import builtin

    cfg = TargetConfig(name="tiny_qwen3", path=str(tmp_path / "tiny"), build="tiny_qwen3", mask_token_id=261)
    monkeypatch.setattr(builtin, "_distributed_rank", lambda: 1)
    monkeypatch.setattr(builtin, "BUILD_WAIT_S", 1)
    with pytest.raises(NotFoundError, match="process 0 to build the target"):
        builtin.ensure_built(cfg)
    assert list(tmp_path.iterdir()) == []  # built nothing itself
    monkeypatch.setattr(builtin, "BUILD_WAIT_S", 30)
    rank0 = threading.Timer(0.5, lambda: (tmp_path / "tiny").mkdir() or (tmp_path / "tiny/config.json").write_text("{}"))
    rank0.start()
    builtin.ensure_built(cfg)
    assert (tmp_path / "tiny/config.json").exists()


def test_a_toy_target_installed_from_an_earlier_shipped_build_is_replaced(tmp_path, caplog):
    """A cache (~/.cache/dflash/targets/toy) filled by an earlier dflash must not keep serving the old toy target."""
    from dflash.config import TargetConfig
    from dflash.target.builtin import ensure_built
    from dflash.target.toy import SHIPPED

    dest = tmp_path / "toy"
    cfg = TargetConfig(name="toy", path=str(dest), build="toy", mask_token_id=5)
    ensure_built(cfg)  # dflash installs it, and marks it as its own
    (dest / "toy_info.json").write_text('{"built": "an earlier build"}')
    (dest / "leftover").write_text("from the old build")
    with caplog.at_level("WARNING"):
        ensure_built(cfg)
    assert (dest / "toy_info.json").read_bytes() == (SHIPPED / "toy_info.json").read_bytes()
    assert not (dest / "leftover").exists() and "earlier build of target toy" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["toy"]  # nothing set aside is left behind
    (dest / "mine").write_text("kept")
    ensure_built(cfg)  # the current build is left alone
    assert (dest / "mine").exists()


def test_a_missing_shipped_toy_target_is_explained_not_rebuilt_otherwise(tmp_path, monkeypatch):
    """Without its shipped copy (a broken install), the toy target is not rebuilt from scratch: that would
    be the first of its recorded build stages only, another target than the one conf/target/toy.yaml names."""
    from dflash.config import TargetConfig
    from dflash.errors import NotFoundError
    from dflash.target import toy
    from dflash.target.builtin import ensure_built

    monkeypatch.setattr(toy, "SHIPPED", tmp_path / "assets" / "toy_target")
    cfg = TargetConfig(name="toy", path=str(tmp_path / "home" / "toy"), build="toy", mask_token_id=5)
    with pytest.raises(NotFoundError, match="shipped toy target is missing .*reinstall dflash"):
        ensure_built(cfg)
    assert list((tmp_path / "home").iterdir()) == []  # no half-built folder left behind


def test_an_unmarked_toy_install_in_the_default_folder_is_replaced(tmp_path, monkeypatch):
    """Installs by a dflash older than the install mark sit in $DFLASH_HOME/targets/toy, unmarked."""
    import shutil

    from dflash.config import TargetConfig
    from dflash.target.builtin import ensure_built
    from dflash.target.toy import SHIPPED

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    dest = tmp_path / "targets" / "toy"
    shutil.copytree(SHIPPED, dest)
    (dest / "toy_info.json").write_text('{"built": "an earlier build"}')
    ensure_built(TargetConfig(name="toy", path=str(dest), build="toy", mask_token_id=5))
    assert (dest / "toy_info.json").read_bytes() == (SHIPPED / "toy_info.json").read_bytes()


def test_a_toy_target_built_at_its_own_path_is_used_as_it_is(tmp_path, monkeypatch, caplog):
    """`python -m dflash.target.toy build --out DIR`, then target.path=DIR: the run used to delete DIR and
    put the shipped build in its place, so 25 minutes of build were lost and the run trained on another target."""
    import shutil

    from dflash.config import TargetConfig
    from dflash.target.builtin import ensure_built
    from dflash.target.toy import SHIPPED

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    dest = tmp_path / "my_toy"
    shutil.copytree(SHIPPED, dest)
    mine = '{"built": "by me, with --steps 900"}'
    (dest / "toy_info.json").write_text(mine)
    with caplog.at_level("WARNING"):
        ensure_built(TargetConfig(name="toy", path=str(dest), build="toy", mask_token_id=5))
    assert (dest / "toy_info.json").read_text() == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_toy"]
    assert "did not install" in caplog.text and "loaded as it is" in caplog.text
    assert "delete" not in caplog.text  # a user's folder is never to be deleted, not even in advice


def test_an_untied_checkpoint_without_lm_head_is_refused_not_given_embed_tokens(tmp_path):
    """heads_only (offline training) reads lm_head from the weight files; an untied checkpoint that lacks it is
    incomplete, and its embed_tokens would give other logits than the target's."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    from dflash.config import TargetConfig
    from dflash.errors import TargetError
    from dflash.target.builtin import tiny_qwen3_config
    from dflash.target.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(len(tok))).save_pretrained(tmp_path)  # tie_word_embeddings false
    tok.save_pretrained(tmp_path)
    cfg = TargetConfig(name="untied", path=str(tmp_path), mask_token_id=261, dtype="float32")
    complete = load_target(cfg, torch.device("cpu"), heads_only=True)
    assert not torch.equal(complete.lm_head.weight, complete.embed_tokens.weight)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetError, match=rf"{tmp_path} is not tied .* no lm_head.weight tensor"):
        load_target(cfg, torch.device("cpu"), heads_only=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = load_target(cfg, torch.device("cpu"), heads_only=True)  # tied: the head is embed_tokens, as written
    assert torch.equal(tied.lm_head.weight, tied.embed_tokens.weight)


def test_the_target_loads_to_the_weights_and_outputs_of_a_plain_from_pretrained(tiny_target):
    """Loading straight to the device (device_map) gives what from_pretrained onto the host gave before."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_target.path, dtype=torch.float32).eval()
    got, want = tiny_target.model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert {b.device.type for b in tiny_target.model.buffers()} == {"cpu"}
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        assert torch.equal(tiny_target.model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_qwen3_5"])
def test_the_target_is_made_on_the_requested_device_not_moved_there(name, dflash_home, monkeypatch):
    """Online training used to fill the whole target on every process's host memory and then .to(device)
    it. On the meta device (the stand-in for a GPU here: what lands there takes no host memory) every
    parameter and buffer is made there, and the model is never moved."""
    from transformers import PreTrainedModel

    moved, real_to = [], torch.nn.Module.to

    def to(module, *args, **kwargs):
        if isinstance(module, PreTrainedModel):
            moved.append((type(module).__name__, args, kwargs))
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    cfg = compose("train", [f"target={name}", "target.dtype=bfloat16"]).target  # a cast, as fp32 files -> bf16
    target = load_target(cfg, torch.device("meta"))
    assert moved == []
    tensors = [*target.model.parameters(), *target.model.buffers()]
    assert {t.device.type for t in tensors} == {"meta"} and target.device.type == "meta"
    assert target.dtype == torch.bfloat16 and target.layers is not None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_loading_holds_no_copy_of_the_model_in_host_memory(tmp_path):
    """A 48M-parameter target stored in float32, loaded as bfloat16 to the meta device in a fresh process:
    the load used to hold the whole cast model on the host (96 MB of process memory) before moving it;
    now host memory holds a few tensors at a time (the largest here is 16 MB)."""
    from tests.target.load_probe import measure, write_target

    write_target(tmp_path, hidden=512, layers=8, vocab=16000)
    probe = measure(tmp_path, "meta", "bfloat16")
    assert probe["devices"] == ["meta"] and probe["model_bytes"] == 47_851_008 * 2
    assert probe["peak_anon"] < probe["model_bytes"] / 4, probe
