"""Quantized targets as published: tiny checkpoints quantized here, offline, in the layouts the published ones use
(gpt-oss's MXFP4 experts, block-scaled FP8 linears as Qwen's and MiniMax's FP8 checkpoints, compressed-tensors'
packed INT4), loaded through transformers' quantizers on this CPU, against the same model with the dequantized
weights written unquantized."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config import TargetConfig
from dflash.errors import CacheError, ProvenanceError, TargetError
from dflash.provenance import check_provenance, check_resumable, features_manifest, live_features
from dflash.target import load_target
from dflash.target.builtin import build
from dflash.target.features import target_forward
from dflash.target.quantization import bits
from tests.conftest import compose

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(w: torch.Tensor):
    """gpt-oss's layout: w [experts, out, in] in blocks of 32 along `in`, each a power-of-two scale (its exponent
    + 127, a byte: `_scales`) and 32 FP4 (e2m1) codes, two a byte, low nibble first (`_blocks` [.., in/32, 16]).
    Returns (blocks, scales, the dequantized w)."""
    e, r, c = w.shape
    groups = w.reshape(e, r, c // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2 ** -100) / 6)).to(torch.int32)
    scale = torch.exp2(exp.float())[..., None]
    codes = ((groups / scale)[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8), (FP4[codes.long()] * scale).reshape(e, r, c)


def _fp8(w: torch.Tensor, block: int, block_rows: int | None = None):
    """DeepSeek/Qwen/MiniMax's block-scaled FP8: e4m3 values, one float32 `weight_scale_inv` a tile of block_rows
    (default: block) x block."""
    r, c = w.shape
    rows = block_rows or block
    tiles = w.reshape(r // rows, rows, c // block, block)
    scale = tiles.abs().amax((1, 3)) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(r, c), scale, (q.float() * scale[:, None, :, None]).reshape(r, c)


def _int4(w: torch.Tensor, group: int):
    """compressed-tensors' pack-quantized INT4 (symmetric, a scale a group of 32 along `in`), packed by the library."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    r, c = w.shape
    scale = w.reshape(r, c // group, group).abs().amax(-1) / 7.5
    codes = torch.clamp(torch.round(w.reshape(r, c // group, group) / scale[..., None]), -8, 7)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**INT4))
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return packed, (codes * scale[..., None]).reshape(r, c)


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
CONFIGS = {
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [  # as gpt-oss-20b's config.json
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT4, "input_activations": None,
                                           "output_activations": None}}, "ignore": ["lm_head"]},
}


def quantize(src: Path, dest: Path, fmt: str) -> tuple[Path, Path]:
    """(the checkpoint at `src` quantized in `fmt`, the same with its dequantized weights stored unquantized)."""
    tensors, quantized, dequantized = load_file(src / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if fmt == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, deq = _mxfp4(w.transpose(1, 2))  # stored [experts, out, in]; the model holds [.., in, out]
            quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            dequantized[name] = deq.transpose(1, 2).contiguous()
        elif fmt in ("fp8", "int4") and "layers." in name and name.endswith("proj.weight") and w.ndim == 2:
            if fmt == "fp8":
                q, scale, dequantized[name] = _fp8(w, 16)
                quantized |= {name: q, f"{name}_scale_inv": scale}
            else:
                packed, dequantized[name] = _int4(w, 32)
                quantized |= {f"{name.removesuffix('weight')}{k}": v for k, v in packed.items()}
        else:
            quantized[name] = dequantized[name] = w
    out = dest / f"{src.name}-{fmt}", dest / f"{src.name}-{fmt}-dequantized"
    for folder, weights, qc in ((out[0], quantized, CONFIGS[fmt]), (out[1], dequantized, None)):
        _write(src, folder, weights, qc)
    return out


def _write(src: Path, dest: Path, weights: dict, quantization_config: dict | None) -> Path:
    shutil.copytree(src, dest)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


ATTENTION = [f"model.layers.*.self_attn.{p}_proj" for p in "koqv"]
MLP = [f"model.layers.*.mlp.{p}_proj" for p in ("down", "gate", "up")]
EXPERTS = [f"model.layers.*.mlp.experts.*.{p}_proj" for p in ("down", "gate", "up")]
CASES = {  # format, tiny target, the modules stored quantized, how transformers runs them on this CPU
    "mxfp4-gpt_oss": ("mxfp4", "tiny_gpt_oss", ["model.layers.*.mlp.experts"], "dequantized at load"),
    "fp8-qwen3": ("fp8", "tiny_qwen3", MLP + ATTENTION, "dequantized at load"),
    "fp8-qwen3_moe": ("fp8", "tiny_qwen3_moe", EXPERTS + ATTENTION, "dequantized at load"),
    "int4-qwen3": ("int4", "tiny_qwen3", MLP + ATTENTION, "quantized (compressed-tensors)"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Built on first use: {case: (unquantized, quantized, dequantized) checkpoint folders}."""
    root, built = tmp_path_factory.mktemp("quantized"), {}

    def get(case: str) -> tuple[Path, Path, Path]:
        fmt, tiny, _, _ = CASES[case]
        if fmt == "int4":
            pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors for the INT4 checkpoint")
        if case not in built:
            src = root / tiny
            if not src.exists():
                build(tiny, src)
            built[case] = (src, *quantize(src, root, fmt))
        return built[case]

    return get


def target_config(path: Path, dtype: str = "float32", **kw) -> TargetConfig:
    attn = "eager" if "gpt_oss" in str(path) else "sdpa"  # transformers runs GPT-OSS's attention sinks in eager only
    return TargetConfig(name=path.name, path=str(path), mask_token_id=5, dtype=dtype, device="cpu",
                        attn_implementation=attn, **kw)


def features(target) -> torch.Tensor:
    ids = torch.randint(0, 250, (2, 48), generator=torch.Generator().manual_seed(0))
    return target_forward(target, ids, list(range(target.num_layers))).features


@pytest.mark.parametrize("case,dtype", [(c, "float32") for c in CASES] + [("mxfp4-gpt_oss", "bfloat16"),
                                                                          ("fp8-qwen3", "bfloat16")])
def test_a_quantized_checkpoint_gives_the_features_of_its_dequantized_weights(checkpoints, case, dtype):
    """Every layer's output equal to the dequantized weights', bit for bit: transformers' dequantization computes the
    products this test computes (FP4 or INT4 codes times their scales, FP8 values times theirs, in float32, rounded
    once to the dtype), and the forward after it is the same computation. compressed-tensors dequantizes in the
    model's dtype (scales rounded to it first), so its bfloat16 features equal bfloat16-dequantized weights'
    instead: float32 here. The weights are not the unquantized ones (the features differ from those)."""
    fmt, _, modules, runs = CASES[case]
    original, quantized, dequantized = checkpoints(case)
    target = load_target(target_config(quantized, dtype))
    assert torch.equal(features(target), features(load_target(target_config(dequantized, dtype))))
    assert not torch.equal(features(target), features(load_target(target_config(original, dtype))))
    record = target.quantization
    assert record["method"] == CONFIGS[fmt]["quant_method"] and record["bits"] == [8 if fmt == "fp8" else 4]
    assert record["runs"] == runs and record["config"]["quant_method"] == record["method"]
    assert record["modules"] == modules and record["versions"]["transformers"]


def test_the_manifest_records_the_quantization_and_keeps_its_features_apart_from_the_unquantized_targets(
        checkpoints, tmp_path):
    """Extraction from the MXFP4 target writes the quantization into the manifest (a record, and the guarded
    `quantized`); a drafter trained on the unquantized target's features refuses them at evaluation, and a cache
    resumed across the two is refused, each naming the field; manifests made before the field existed match the
    unquantized target."""
    from dflash.data.extraction import extract_training
    from dflash.dist import Dist

    original, quantized, _ = checkpoints("mxfp4-gpt_oss")
    job = compose("extract", ["target=tiny_gpt_oss", f"target.path={quantized}", "data=tiny", "data.limit=3",
                              "data.completions.max_new_tokens=8", f"features.dir={tmp_path}/f"])
    target = load_target(job.target)
    manifest = extract_training(job, target, Dist())
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["quantized"] == manifest["quantized"] \
        == "mxfp4, 4-bit, dequantized at load"
    assert manifest["quantization"]["modules"] == ["model.layers.*.mlp.experts"]

    plain = load_target(target_config(original))
    trained_on = features_manifest(plain, [1, 3], "float32", 64, {}, 8)
    assert "quantized" not in trained_on and trained_on["quantization"] is None
    with pytest.raises(ProvenanceError) as refused:
        check_provenance(trained_on, live_features(target, [1, 3]), ["target"])
    message = str(refused.value)
    assert "quantized: null in the checkpoint, mxfp4, 4-bit, dequantized at load in the features" in message
    assert "provenance.allow_mismatch=[quantized]" in message and len(message.splitlines()) == 3
    assert check_provenance(trained_on, live_features(target, [1, 3]), ["target", "quantized"]) == ["target",
                                                                                                   "quantized"]
    with pytest.raises(CacheError, match="quantized: cache has null"):
        check_resumable({**manifest, "quantized": None}, manifest, tmp_path)
    old = {k: v for k, v in trained_on.items() if k not in ("quantized", "quantization")}
    assert check_provenance(old, live_features(plain, [1, 3])) == []


def test_a_cpu_placement_dequantizes_mxfp4_and_fp8_even_where_a_gpu_is_visible(checkpoints, monkeypatch):
    """transformers dequantizes them by itself only where it sees no GPU; target.device=cpu on a GPU machine would
    bind its GPU kernels to CPU tensors. dflash asks for the dequantization on any CPU placement."""
    _, quantized, dequantized = checkpoints("fp8-qwen3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    target = load_target(target_config(quantized))
    assert target.quantization["runs"] == "dequantized at load"
    monkeypatch.undo()
    assert torch.equal(features(target), features(load_target(target_config(dequantized))))


@pytest.mark.parametrize("quantization,named", [
    ({"quant_method": "fbgemm_fp8"}, "requires a GPU"),
    ({"quant_method": "hqq", "quant_config": {"nbits": 4, "group_size": 64}, "skip_modules": ["lm_head"]}, "HQQ"),
    ({"quant_method": "nvfp4"}, "not supported"),
    ({"quant_method": "no_such_format"}, "Unknown quantization type"),
])
def test_a_quantization_transformers_cannot_load_on_this_device_is_refused_in_one_line(checkpoints, tmp_path,
                                                                                          quantization, named):
    """Only config.json is read: the refusal comes before any weight (these are not quantized at all)."""
    original, _, _ = checkpoints("fp8-qwen3")
    folder = _write(original, tmp_path / "declared", load_file(original / "model.safetensors"), quantization)
    with pytest.raises(TargetError) as refused:
        load_target(target_config(folder))
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and named in message and quantization["quant_method"] in message
    assert "cannot load it on the CPU" in message and "target.device=cuda" in message and "unquantized" in message


def test_heads_only_reads_unquantized_heads_of_a_quantized_checkpoint_and_refuses_quantized_ones(checkpoints,
                                                                                                  tmp_path):
    """gpt-oss keeps embed_tokens and lm_head unquantized: offline training reads them from the files. A head stored
    in FP8 (its scales beside it) would be read as its raw values: refused, naming it and what to do."""
    original, quantized, _ = checkpoints("mxfp4-gpt_oss")
    whole, heads = load_target(target_config(quantized)), load_target(target_config(quantized), heads_only=True)
    assert torch.equal(heads.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(heads.embed_tokens.weight, whole.embed_tokens.weight)
    assert heads.quantization["method"] == "mxfp4" and heads.quantization["runs"] is None

    src, _, _ = checkpoints("fp8-qwen3")
    weights = load_file(src / "model.safetensors")
    q, scale, _ = _fp8(weights["lm_head.weight"], 16, block_rows=2)  # a vocabulary of 262 rows
    weights |= {"lm_head.weight": q, "lm_head.weight_scale_inv": scale}
    folder = _write(src, tmp_path / "fp8-head", weights, CONFIGS["fp8"])
    with pytest.raises(TargetError, match=r"^\S+ stores the target's lm_head quantized \(lm_head.weight: F8_E4M3, "
                                          r"lm_head.weight_scale_inv: F32\).*"
                                          r"train.mode=online[^\n]*$"):
        load_target(target_config(folder), heads_only=True)


def test_a_quantized_model_loaded_by_hand_carries_its_quantization(checkpoints):
    """as_target (the Python API's plain HF model) records what the model it is given still knows of its
    quantization: compressed-tensors keeps its config on the model."""
    from transformers import AutoModelForCausalLM

    from dflash.target import as_target

    _, quantized, _ = checkpoints("int4-qwen3")
    model = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    record = as_target(model).quantization
    assert record["method"] == "compressed-tensors" and record["runs"] == "quantized (compressed-tensors)"
    assert record["modules"] is None  # no folder to read the stored tensors from


def test_weight_bits_as_each_format_states_them():
    assert bits(CONFIGS["int4"]) == [4] and bits(CONFIGS["mxfp4"]) == [4] and bits(CONFIGS["fp8"]) == [8]
    assert bits({"quant_method": "bitsandbytes", "load_in_4bit": True}) == [4]
    assert bits({"quant_method": "gptq", "bits": 3}) == [3]
    assert bits({"quant_method": "hqq", "quant_config": {"nbits": 2}}) == [2]
    mixed = {"quant_method": "compressed-tensors", "config_groups": {
        "attention": {"weights": {"num_bits": 8}}, "experts": {"weights": {"num_bits": 4}}}}
    assert bits(mixed) == [4, 8]
