"""The GPU check: what to run on a GPU machine first (before renting a node, on first contact with one, after an
upgrade of torch, transformers or fla). Each check prints one `PASS|FAIL|SKIP <check> <figures or why>` line, runs
in a process of its own with a time limit, and the report, bench/results/<date>-<gpu>-gpu-check.json, is rewritten
after every check. Without CUDA the GPU-only checks say SKIP and the others run small. bench/README.md says what
each line means.

    bash bench/prepare_wheels.sh                 # here, with network: .whl/, what a GPU machine lacks
    bash bench/gpu_check.sh                      # there: installs .whl/ beside the environment, runs every check
    python -m bench.gpu.checks --only qwen3_6_step live_lossless   # some checks, as a report of their own
    bash bench/gpu_real.sh                       # the real-model twin: python -m bench.gpu.real

- checks: the checks by name, their time limits and the command line (`python -m bench.gpu.checks`).
- runner: runs them, each in its own process, into a report that survives a killed check or run.
- verdicts: PASS or FAIL from what a check measured (pure functions, judged on fabricated results in the tests).
- steps: the drafter's training step measured (flex over context lengths, the presets' steps, autocast's gap);
  two of its measurements are also `python -m bench` suites.
- layers: the step's layers under each gradient checkpointing mode, and compiled per layer.
- profile: one step under torch.profiler, its time by op class.
- target: the target side: the linear-attention kernels, and live decoding lossless against the target's argmax.
- real: the real-model twin, SmolLM2-135M through extract, train and evaluate on one GPU (`bash bench/gpu_real.sh`).

tests/bench/gpu/ runs the same code on CPU at tiny sizes.
"""
