"""Memory plan of one training step per GPU, and what the run needs besides, before renting GPUs.

    python -m dflash.plan experiment=qwen3_6_27b
    python -m dflash.plan experiment=qwen3_8b train.num_anchors=1024 gpu_gb=[80,141]
    python -m dflash.plan experiment=qwen3_6_27b train.distributed=fsdp world_size=8 --json
    python -m dflash.plan --config-dir ~/my_conf target=mine    # your own target/mine.yaml, as train.py takes it

Arguments: train.py's Hydra overrides (conf/train.yaml), its --config-dir / -cd (a folder of your own configs,
searched beside conf/) and --config-name / -cn, plus plan-only keys: gpu_gb (GiB, one or a list;
default [80,141]), world_size (data-parallel processes; 1), allowance_gb (CUDA context, NCCL; 2),
fragmentation (share of the peak lost to the caching allocator; 0.1), sequences and tokens_per_sequence
(the training data; default: the prompts data.prompts holds, else the DFlash paper's ~800K, and 1500
tokens, the paper's ~1.2B tokens / 800K, at most data.max_length), mfu (default: measured on a GPU, from
bench/results/: the experiment preset's own step where measured, else the median; with none, 0.35),
peak_tflops (the GPU's dense bf16; 989, H100/H200) and disk_tb (room for a feature cache; 20). --json prints
JSON. (`python -m dflash.plan` is the same command, under its old name.)
"""

from dflash.plan.report import main

main()
