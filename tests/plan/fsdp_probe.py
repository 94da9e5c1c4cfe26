"""Peak tensor bytes of an FSDP2 training step on each process, on CPU (gloo), for tests/plan/test_plan.py:

    accelerate launch --multi_gpu --num_processes 2 ... tests/plan/fsdp_probe.py OUT_DIR no|bf16

The drafter is set up as dflash/train/accel.py and loop.py do (accelerate's FSDP2 plugin from
accel.fsdp_plugin, forced on as tests/train/test_distributed.py's FSDP_ON_CPU does: accelerate makes DDP of
FSDP on a CPU), and the step is the loop's: draft_packed and block_loss under acc.autocast, acc.backward,
acc.clip_grad_norm_, AdamW. Each process writes OUT_DIR/peak-<rank>.json.
"""

import json
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bench.measure import TensorPeak
from dflash.config import OptimConfig
from dflash.drafter.blocks import draft_packed, pack_blocks
from dflash.drafter.build import drafter_config
from dflash.drafter.loss import block_loss
from dflash.drafter.model import DFlashDraftModel
from dflash.train import accel
from dflash.train.optim import build_optimizer

DIMS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 512, "vocab_size": 512, "num_hidden_layers": 8}
LAYERS, BLOCK, N_TARGET, LENGTH, ANCHORS = 6, 8, 3, 64, 8


class ShardedPeak(TensorPeak):
    """TensorPeak that also follows FSDP2: DTensors count their local shard, and a storage counts its bytes
    now (FSDP2 frees and regrows the gathered parameters' storages in place, with resize_)."""

    @property
    def live(self) -> int:
        self._live = {k: v for k, v in self._live.items() if not v.expired()}
        return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes() for ref in self._live.values())

    def _see(self, outputs, op) -> None:
        from torch.distributed.tensor import DTensor

        live = self.live
        for t in outputs:
            t = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st._cdata not in self._live:  # the storage itself, whatever its size or address now
                    self._live[st._cdata] = StorageWeakRef(st)
                    live += st.nbytes()
        if live > self.peak:
            self.peak, self.peak_op = live, str(op)


def main() -> None:
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import Qwen3Config

    out, precision = Path(sys.argv[1]), sys.argv[2]
    plugin = accel.fsdp_plugin()
    acc = Accelerator(mixed_precision=precision, fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    vocab = DIMS["vocab_size"]
    config = drafter_config(Qwen3Config(**DIMS), num_layers=LAYERS, block_size=BLOCK,
                            target_layer_ids=list(range(N_TARGET)), mask_token_id=vocab - 1)
    drafter = DFlashDraftModel(config).float().train()
    frozen = torch.bfloat16 if precision == "bf16" else torch.float32
    embed = torch.nn.Embedding(vocab, DIMS["hidden_size"]).to(frozen).requires_grad_(False)
    head = torch.nn.Linear(DIMS["hidden_size"], vocab, bias=False).to(frozen).requires_grad_(False)
    model, optimizer = acc.prepare(drafter, build_optimizer(drafter, OptimConfig()))
    ids = torch.randint(0, vocab - 1, (1, LENGTH))
    anchors = torch.linspace(0, LENGTH - 2, ANCHORS).round().long()
    blocks = pack_blocks(ids, torch.ones(1, LENGTH, dtype=torch.bool), torch.tensor([LENGTH]), [anchors], BLOCK,
                         vocab - 1)
    features = torch.randn(1, LENGTH, N_TARGET * DIMS["hidden_size"])

    def step():
        with acc.autocast():
            hidden = draft_packed(model, embed, features, blocks, "sdpa", model=model)
            loss_sum, weight, _ = block_loss(hidden, head.weight, blocks.labels, blocks.label_mask, 7.0, 0)
        acc.backward(loss_sum / weight)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step makes AdamW's state
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    with ShardedPeak() as mem:
        mem.track(*[local(p) for p in model.parameters()], *model.buffers(), embed.weight, head.weight, features,
                  ids, *[local(v) for state in optimizer.state.values() for v in state.values()],
                  *[v for v in vars(blocks).values() if torch.is_tensor(v)])
        step()
    (out / f"peak-{acc.process_index}.json").write_text(json.dumps({
        "peak": mem.peak, "op": mem.peak_op, "world": acc.num_processes,
        "sharded": type(next(model.parameters())).__name__}))
    acc.end_training()  # the group ended before exit (left to it, gloo's threads can abort a process)


if __name__ == "__main__":
    main()
