"""Extract target features (and completions) into a provenance-stamped cache.

    python extract.py                                  # the embedded default
    python extract.py target=qwen3_8b data=jsonl data.prompts=prompts.jsonl
    accelerate launch --num_processes 8 extract.py target=qwen3_8b data=jsonl data.prompts=...
    python extract.py features.storage=float8_e4m3fn  # about half the disk of bf16
"""

import hydra

from dflash.cli import refuse_moved_keys, run, to_job
from dflash.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="extract")
def main(cfg) -> None:
    job = to_job(cfg)  # config errors stop here, before anything heavy is imported
    from dflash.data.extraction import extract

    run(extract, job)


if __name__ == "__main__":
    refuse_moved_keys()
    main()
