"""Quantized targets as published (gpt-oss's MXFP4, block-scaled FP8, compressed-tensors INT4, ...): what a
checkpoint's quantization is, whether transformers can load it on the device asked for, how it is loaded, and what
the manifests record of it.

transformers loads a quantized checkpoint through the quantizer its config.json names (`quantization_config`). Its
MXFP4 and FP8 forwards are GPU kernels (Triton or DeepGEMM, fetched from the hub by the `kernels` package); where
they cannot run it dequantizes the weights at load instead, to the dtype asked for, and dflash asks for that on any
CPU placement (also on a machine whose GPU would otherwise bind the kernels to CPU tensors). compressed-tensors
decompresses its packed integers in PyTorch on any device. Features so computed are those of the dequantized
weights (tests/target/test_quantization.py: equal in float32). Features run through quantized kernels differ from
those (other sums; FP8 kernels quantize the activations too), and every one of them from an unquantized target's:
the manifest records the quantization (`record`) and keeps such features apart (the guarded `signature`).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
from pathlib import Path

from dflash.errors import TargetError

DEQUANTIZED_ON_CPU = ("mxfp4", "fp8")
"""Formats whose quantized forward is GPU kernels only: loaded on a CPU, their weights are dequantized at load."""

BITS = {"mxfp4": 4, "fp8": 8, "fbgemm_fp8": 8, "nvfp4": 4}
"""Weight bits of the formats whose config does not state them."""

LIBRARIES = {"mxfp4": "kernels", "fp8": "kernels", "compressed-tensors": "compressed-tensors",
             "bitsandbytes": "bitsandbytes", "gptq": "gptqmodel", "awq": "gptqmodel", "hqq": "hqq",
             "quanto": "optimum-quanto", "torchao": "torchao", "fbgemm_fp8": "fbgemm-gpu"}
"""The package that runs each format besides transformers (mxfp4, fp8: `kernels`, which fetches their kernels)."""

_QUANT_MODULES = ("transformers.integrations.", "bitsandbytes", "compressed_tensors", "optimum.quanto", "hqq",
                  "torchao", "gptqmodel")
"""Where the modules a quantizer puts into a model are defined."""

_FLOAT = {"F64", "F32", "F16", "BF16"}


def declared(hf_config) -> dict | None:
    """The checkpoint's `quantization_config` (as config.json holds it), None for an unquantized checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def method(qc: dict) -> str:
    m = qc.get("quant_method", "?")
    return str(getattr(m, "value", m))


def bits(qc: dict) -> list[int]:
    """The weight bits the config states (compressed-tensors: each config group's; several where groups differ,
    e.g. FP8 attention beside INT4 experts)."""
    groups = qc.get("config_groups") or {}
    found = {g["weights"]["num_bits"] for g in groups.values() if isinstance(g, dict) and g.get("weights")}
    for where in (qc, qc.get("quant_config") or {}):  # hqq nests its settings
        found |= {where[k] for k in ("bits", "num_bits", "nbits") if isinstance(where.get(k), int)}
    if qc.get("load_in_4bit"):
        found.add(4)
    elif qc.get("load_in_8bit"):
        found.add(8)
    if not found and method(qc) in BITS:
        found.add(BITS[method(qc)])
    return sorted(found)


def tensor_dtypes(model_dir: Path) -> dict[str, str]:
    """{tensor name: safetensors dtype (F32, BF16, F8_E4M3, U8, I32, ...)} of every weight file, from the headers
    alone (a few KiB a file, however large the checkpoint)."""
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        out.update({name: info["dtype"] for name, info in header.items() if name != "__metadata__"})
    return out


def module_of(tensor: str) -> str:
    """The module a stored tensor belongs to: `model.layers.0.self_attn.q_proj` for its `.weight`,
    `.weight_packed`, `.weight_scale_inv`, `.weight.absmax` (bitsandbytes) or `.qweight` (GPTQ);
    `model.layers.0.mlp.experts` for MXFP4's `gate_up_proj_blocks`."""
    parts = tensor.split(".")
    for i, part in enumerate(parts):
        if "weight" in part or part in ("qzeros", "scales", "g_idx") or part.endswith(("_blocks", "_scales")):
            return ".".join(parts[:i])
    return ".".join(parts[:-1])


def quantized_modules(model_dir: Path) -> list[str]:
    """The modules whose weights the checkpoint stores quantized (a tensor of theirs is not a float: packed 4-bit
    values, FP8, exponent scales), layer and expert numbers written `*`."""
    return sorted({re.sub(r"\.\d+(?=\.|$)", ".*", module_of(name))
                   for name, dtype in tensor_dtypes(model_dir).items() if dtype not in _FLOAT})


def check_heads(model_dir: Path) -> None:
    """Refuse in one line an embedding table or head the checkpoint stores quantized (packed, in FP8, or with
    scales beside it): heads-only loading reads them straight from the weight files."""
    stored: dict[str, dict[str, str]] = {}
    for name, dtype in sorted(tensor_dtypes(model_dir).items()):
        module = module_of(name)
        if module.endswith(("embed_tokens", "lm_head")) and not module.startswith(("mtp.", "model.visual.", "visual.")):
            stored.setdefault(module, {})[name] = dtype
    for module, tensors in stored.items():
        if any(name not in (f"{module}.weight", f"{module}.bias") or dtype not in _FLOAT
               for name, dtype in tensors.items()):
            listed = ", ".join(f"{name}: {dtype}" for name, dtype in tensors.items())
            raise TargetError(
                f"{model_dir} stores the target's {module} quantized ({listed}), and the heads are read "
                f"straight from the weight files, not dequantized: train online (train.mode=online loads the whole "
                f"target through transformers' quantizer), or use a checkpoint whose embed_tokens and lm_head are "
                f"stored unquantized")


def loading_kwargs(qc: dict, placement, name: str, path: str) -> dict:
    """What `from_pretrained` needs besides the checkpoint's own config to load it on `placement` (a device map,
    or accelerate's "auto"): on a CPU, MXFP4 and FP8 dequantized at load. A format transformers cannot load
    there (its kernels need a GPU, its library is missing, it is not one transformers knows) is refused in one
    line, by transformers' own check, before any weight is read."""
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.auto import AutoQuantizationConfig

    cpu = isinstance(placement, dict) and all(str(d).startswith("cpu") for d in placement.values())
    kwargs = {}
    try:
        config = AutoQuantizationConfig.from_dict(copy.deepcopy(qc))
        if cpu and method(qc) in DEQUANTIZED_ON_CPU and not getattr(config, "dequantize", False):
            config.dequantize = True
            kwargs["quantization_config"] = config
        AutoHfQuantizer.from_config(copy.deepcopy(config), pre_quantized=True).validate_environment(
            device_map=placement, weights_only=True)
    except Exception as e:  # noqa: BLE001  (whatever transformers' check raises names the reason)
        reason = " ".join(str(e).split())[:300]
        where = "the CPU" if cpu else ", ".join(sorted({str(d) for d in placement.values()})) \
            if isinstance(placement, dict) else f"target.device_map={placement}"
        raise TargetError(
            f"target {name}: {path} is quantized ({method(qc)}, config.json quantization_config) and transformers "
            f"cannot load it on {where} here: {reason}. Load it where its kernels run (a CUDA GPU, target.device="
            f"cuda, with the library it names installed), or point target.path at an unquantized or dequantized "
            f"copy of the checkpoint") from e
    return kwargs


def runs(model) -> str:
    """How the loaded model computes with its quantized weights: dequantized at load, or through the modules its
    quantizer put in (e.g. `quantized (Mxfp4GptOssExperts, Mxfp4GptOssMLP)`)."""
    if not getattr(model, "is_quantized", False):  # transformers drops the quantizer once it has dequantized
        return "dequantized at load"
    names = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith(_QUANT_MODULES)}
    if any(hasattr(m, "quantization_scheme") for m in model.modules()):  # compressed-tensors keeps nn.Linear
        names.add("compressed-tensors")
    return f"quantized ({', '.join(sorted(names))})" if names else "quantized"


def record(qc: dict, model_dir: Path | None, model) -> dict:
    """What the manifests record of a quantized target: its format, weight bits, the modules stored quantized,
    how it ran (None: heads only, not run), the checkpoint's quantization_config and the libraries' versions."""
    libraries = ["transformers"] + ([LIBRARIES[method(qc)]] if method(qc) in LIBRARIES else [])
    return {"method": method(qc), "bits": bits(qc),
            "modules": quantized_modules(model_dir) if model_dir is not None else None,
            "runs": runs(model) if model is not None else None, "config": qc,
            "versions": {lib: _version(lib) for lib in libraries}}


def signature(quantization: dict | None) -> str | None:
    """The guarded form of a record: what makes the features other than an unquantized target's (format, bits, how
    it ran), None for an unquantized target (as in manifests made before quantized targets were)."""
    if quantization is None:
        return None
    width = "/".join(map(str, quantization["bits"]))
    return ", ".join(p for p in (quantization["method"], f"{width}-bit" if width else "", quantization["runs"]) if p)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
