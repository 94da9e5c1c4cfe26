"""Building, loading and exporting drafters: what a serving framework or another tool reads."""

import json
import os
import subprocess
import sys

import torch

from dflash.drafter.build import load_drafter, save_drafter
from tests.drafter.test_model import inputs, make_drafter

CLEAN_LOAD = """
import sys, torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__name__ == "DFlashDraftModel", type(model)
assert not any(name == "dflash" or name.startswith("dflash.") for name in sys.modules)
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(x["noise"], x["feats"], x["pos"]), sys.argv[3])
"""


def test_a_saved_drafter_builds_through_automodel_in_a_clean_process(tmp_path):
    model = make_drafter(["sliding_attention", "full_attention"], 6)
    save_drafter(model, tmp_path / "drafter")
    noise, feats, pos = inputs()
    torch.save({"noise": noise, "feats": feats, "pos": pos}, tmp_path / "in.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", CLEAN_LOAD, str(tmp_path / "drafter"), str(tmp_path / "in.pt"),
                             str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        ours = model(noise, feats, pos)
    assert (torch.load(tmp_path / "out.pt") - ours).abs().max() < 1e-6
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def test_config_holds_both_spellings_of_the_rope_and_dtype_keys(tmp_path):
    model = make_drafter()
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())  # as a transformers-4-style reader sees it
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] > 0
    assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    assert config["torch_dtype"] == config["dtype"] == "float32"
    noise, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(load_drafter(str(tmp_path))(noise, feats, pos), model(noise, feats, pos))
