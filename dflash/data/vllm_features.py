"""Features from vLLM (features.source=vllm): the target runs in vLLM, our cache is written here.

vLLM's `extract_hidden_states` speculative method, with a KV connector that writes each request's hidden states
to safetensors, runs in a venv of its own (features.vllm.python; vLLM never goes into dflash's venv) through
dflash/data/vllm_runtime/vllm_extract.py, which vLLM's CPU build runs with the connector shim of
vllm_runtime/vllm_hidden_states.py (both ship with the package and import no dflash). This module hands it the
prepared sequences shard by shard and stores each shard it returns with `dflash.data.cache.write_shard`: the same
token ids, loss masks and offsets as extraction by transformers, the same resumable cache. vLLM numbers a layer's
output one higher than we do: its id l is the input of decoder layer l, the output of layer l - 1 (HF
`output_hidden_states[l]`), as vLLM's own DFlash serving maps `target_layer_ids` (i + 1).

The manifest is `dflash.provenance.features_manifest`'s with what vLLM ran in place of what transformers would
have: `kernels` (engine=vllm and the attention backend of each kind of vLLM layer) and so `kernel_backend`, the
device, the vLLM venv's versions, `engine` (name, version, tensor and expert parallel, dtype, engine arguments,
the connector, seconds) and `sharding`. kernel_backend keeps these features apart from transformers' (a drafter
trained on one is refused on the other unless provenance.allow_mismatch=[kernel_backend]): they agree within
float32 rounding on the tiny target on a CPU (`make engines`), but vLLM's GPU kernels (fused norms and residuals,
its attention and MoE kernels, and bf16) are not shown equal to transformers', as fla's were not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.config import FeaturesConfig, TargetConfig
from dflash.data import cache as fcache
from dflash.data.sequences import Prepared
from dflash.dist import Dist
from dflash.errors import ConfigError, NotFoundError, TargetError
from dflash.io import read_json, write_json
from dflash.layout import CacheLayout
from dflash.provenance import features_manifest
from dflash.target.identity import kernel_backend
from dflash.target.loading import Target

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).resolve().parent / "vllm_runtime" / "vllm_extract.py"
"""What runs in the vLLM venv (vllm_runtime/: it imports no dflash; its folder goes on vLLM's PYTHONPATH)."""
READY, SHARD = "dflash-vllm ready", "dflash-vllm shard"


def vllm_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Our layer ids in vLLM's numbering (+1). The last layer is refused: we take its output after the final
    norm (as transformers reports it), vLLM's id num_layers is before it."""
    if num_layers - 1 in layer_ids:
        raise ConfigError(f"features.source=vllm cannot give layer {num_layers - 1}, the target's last: vLLM's "
                          f"hidden state there is before the final norm, ours after it; drop it from layers.ids "
                          f"or set features.source=hf")
    return [i + 1 for i in layer_ids]


def vllm_python(cfg: FeaturesConfig) -> str:
    """features.vllm.python, checked."""
    python = Path(cfg.vllm.python).expanduser()
    if not python.exists():
        raise NotFoundError(f"features.vllm.python={cfg.vllm.python} does not exist: `make .venv-engines/vllm/"
                            f".installed` builds vLLM's CPU build there; on a GPU, point it at a python with vllm")
    return str(python)


def engine_manifest(manifest: dict, report: dict, cfg: FeaturesConfig, dtype: str) -> dict:
    """`manifest` (features_manifest's, made with the target's heads) with what vLLM ran (`report`, from
    engine.json) in place of what transformers would have."""
    kernels = {"engine": "vllm", **{f"vllm.{kind}": name for kind, name in sorted(report["attention"].items())}}
    tp = cfg.vllm.tensor_parallel
    out = {k: v for k, v in manifest.items() if k != "layout"}
    if tp > 1:  # not verified equal to one device's (vLLM's reductions differ): kept apart, as layout() does
        out["layout"] = f"vllm tensor_parallel={tp}"
    out.update(
        kernels=kernels, kernel_backend=kernel_backend(kernels), device=report["device"],
        versions={"dflash-train": manifest["versions"].get("dflash-train"), **report["versions"]},
        sharding={"engine": "vllm", "tensor_parallel": tp, "expert_parallel": tp if cfg.vllm.expert_parallel else 1,
                  "device_map": None},
        engine={"name": "vllm", "version": report["versions"].get("vllm"), "tensor_parallel": tp,
                "expert_parallel": cfg.vllm.expert_parallel, "dtype": dtype, "engine_args": dict(cfg.vllm.engine_args),
                "connector": report["connector"], "vllm_layer_ids": report["vllm_layer_ids"]})
    return out


def _write_inputs(work: Path, k: int, sequences) -> None:
    lengths = torch.tensor([0] + [s.input_ids.numel() for s in sequences])
    save_file({"input_ids": torch.cat([s.input_ids for s in sequences]).to(torch.int32).contiguous(),
               "offsets": lengths.cumsum(0).to(torch.int64)}, str(work / f"in-{k}.safetensors"))


def _store_shard(root: Path, work: Path, k: int, sequences, storage: str, n_layers: int, stamp) -> int:
    """vLLM's shard k ([T, layers, H]) into cache shard k ([T, layers * H]); the number of tokens."""
    path = work / f"out-{k}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        states, ids = f.get_tensor("hidden_states"), f.get_tensor("input_ids")
    ours = torch.cat([s.input_ids for s in sequences])
    if not torch.equal(ids.long(), ours.long()):
        raise TargetError(f"vLLM's shard {k} ({path}) holds other token ids than were sent; the cache is left as "
                          f"it was: run extract.py again")
    feats = list(states.reshape(states.shape[0], -1).split([s.input_ids.numel() for s in sequences]))
    fcache.write_shard(root, k, [s.id for s in sequences], [s.input_ids for s in sequences],
                       [s.loss_mask for s in sequences], feats, storage, n_layers, stamp=stamp)
    path.unlink()
    (work / f"in-{k}.safetensors").unlink(missing_ok=True)
    return ids.numel()


def extract_features_vllm(target: Target, target_cfg: TargetConfig, layer_ids: list[int], prepared: Prepared,
                          dest: Path, dist: Dist, cfg: FeaturesConfig, max_length: int | None) -> dict:
    """Features of `prepared` (layers `layer_ids`) computed by vLLM into the cache at `dest`, every shard not yet
    on disk, then the manifest is finalized. `target` needs only its heads and tokenizer (the manifest's
    identity); vLLM loads target_cfg.path itself, in target_cfg.dtype. Returns the manifest."""
    if dist.world > 1:
        raise ConfigError(f"features.source=vllm runs one vLLM engine, which shards the target itself "
                          f"(features.vllm.tensor_parallel); start extract.py as one process, not {dist.world}")
    ids = vllm_layer_ids(layer_ids, target.num_layers)
    python = vllm_python(cfg)
    root, seqs = Path(dest), prepared.sequences
    num_shards = math.ceil(len(seqs) / cfg.shard_sequences)
    part = lambda k: seqs[k * cfg.shard_sequences:(k + 1) * cfg.shard_sequences]  # noqa: E731
    # with every shard on disk vLLM still starts: what it runs decides whether the cache is this configuration's
    done = fcache.done_shards(root) if root.exists() else {}
    todo = [k for k in range(num_shards) if k not in done]
    work = root / ".vllm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for k in todo:
        _write_inputs(work, k, part(k))
    request = {"target": str(Path(target_cfg.path).expanduser()), "dtype": target_cfg.dtype, "vllm_layer_ids": ids,
               "tensor_parallel": cfg.vllm.tensor_parallel, "expert_parallel": cfg.vllm.expert_parallel,
               "max_model_len": max(s.input_ids.numel() for s in seqs) + 1,  # + the one token it generates
               "engine_args": dict(cfg.vllm.engine_args), "work": str(work), "shards": todo}
    (work / "request.json").write_text(json.dumps(request))
    stamp, stored = fcache.Stamp(root, 0), []

    def ready(report: dict) -> None:  # what vLLM runs is known now: the manifest, checked against an unfinished cache
        made = features_manifest(target, layer_ids, cfg.storage, max_length, prepared.info, cfg.shard_sequences)
        fcache.open_for_writing(root, engine_manifest(made, report, cfg, target_cfg.dtype))

    def shard(k: int) -> None:
        stored.append(_store_shard(root, work, k, part(k), cfg.storage, len(layer_ids), stamp))
        log.info("vLLM shard %d stored (%d of %d; %d tokens)", k, len(stored), len(todo), sum(stored))

    log_path = root.parent / f"{root.name}.vllm.log"
    log.info("vLLM (%s) extracts shards %s of %d; its log: %s", python, todo, num_shards, log_path)
    t0 = time.time()
    try:
        report = _follow([python, str(SCRIPT), str(work / "request.json")], work, log_path, ready, shard)
    finally:  # its inputs and outputs (vLLM's log, outside, keeps what went wrong)
        shutil.rmtree(work, ignore_errors=True)
    path = CacheLayout(root).manifest
    manifest = read_json(path)
    manifest["engine"].update(load_s=round(report["load_s"], 2), extract_s=round(report["extract_s"], 2),
                              tokens=report["tokens"], seconds=round(time.time() - t0, 2))
    write_json(path, manifest)
    return fcache.finalize(root, num_shards)


def _follow(cmd: list[str], work: Path, log_path: Path, ready, shard) -> dict:
    """Run the vLLM process, its output into log_path: `ready(report)` once its engine is up, `shard(k)` as each
    shard is out. Its report (engine.json); a TargetError naming vLLM's error when it fails."""
    # vLLM's workers import the connector shim by name, from the script's folder
    paths = [str(SCRIPT.parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                out.write(line)
                if line.startswith(READY):
                    ready(json.loads((work / "engine.json").read_text()))
                elif line.startswith(SHARD):
                    shard(int(line.split()[-1]))
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine runs in processes of its own, in this session
            proc.wait()
            raise
    engine = work / "engine.json"
    report = json.loads(engine.read_text()) if engine.exists() else {}
    if proc.returncode or "error" in report or "extract_s" not in report:
        why = root_cause(log_path.read_text()) or report.get("error") or \
            f"it exited with status {proc.returncode} before saying why"
        raise TargetError(f"vLLM did not extract the features: {why.splitlines()[0][:400]} (log: {log_path})")
    return report


def root_cause(log_text: str) -> str | None:
    """The first exception a vLLM process logged (`ValueError: ...`), without vLLM's prefix: what its engine
    process reports last ("Engine core initialization failed. See root cause above") names none."""
    for line in log_text.splitlines():
        found = re.search(r"(?:^|\] |\) )((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit): .*)", line)
        if found:
            return found.group(1)
    return None
