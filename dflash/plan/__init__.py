"""Memory and cost planning of a training run, a user feature (`python -m dflash.plan`, DESIGN §1).

The pure models take plain shapes and values and import nothing of the pipeline: the per-GPU peak of a step
(memory.py, which training also reads to refuse a step that does not fit and to choose gradient checkpointing),
model FLOPs (flops.py), the feature cache, host memory, GPU-hours and the set-up to train with (costs.py), the real
targets' dimensions (targets.py), and what a drafter buys at a concurrency when served (serving.py). Above drafter/
sit what reads a configured run (configured.py: shapes, setups, a target's config, the measured MFU; compose.py: the
config groups as train.py composes them) and the command (report.py, `python -m dflash.plan`; `... concurrency=[1,8,32]
tau=...` prints the serving section). Import each from its module; this package imports nothing, so that config/ and
training can read the pure models without loading the command."""
