"""Train a DFlash drafter. One Hydra config drives everything; see conf/train.yaml.

    python train.py                                    # the embedded default, on CPU
    python train.py target=qwen3_8b data=jsonl data.prompts=prompts.jsonl
    accelerate launch --num_processes 8 train.py experiment=qwen3_8b data.prompts=prompts.jsonl
    python train.py run.name=my-run train.resume=latest
    python train.py -m optim.lr=3e-4,6e-4 loss.gamma=5,7  # a sweep: one run folder and W&B run each
    python train.py --cfg job                          # print the resolved config
"""

import hydra

from dflash.cli import refuse_moved_keys, run, to_job
from dflash.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg) -> None:
    job = to_job(cfg)  # config errors stop here, before anything heavy is imported
    from dflash.train.loop import train

    run(train, job)


if __name__ == "__main__":
    refuse_moved_keys()
    main()
