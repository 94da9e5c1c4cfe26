"""A configured run as the memory model (dflash.plan.memory) takes it: the Shape of a drafter and its target's text
config (MoE experts, the MLP width a token runs through, the sliding window) and the Setup of the config groups."""

from __future__ import annotations

from dflash.plan.memory import GiB, Setup, Shape


def moe_experts(text) -> tuple[int, int]:
    """(experts, experts a token runs through) of a text config's MoE layers (dflash.target.identity's reading of
    the families' spellings); (0, 0) for a dense model, or one whose experts per token the config does not say."""
    from dflash.target.identity import moe_experts as read_experts

    experts, top_k = read_experts(text)
    return (experts, top_k) if experts and top_k else (0, 0)


def active_intermediate(text) -> int:
    """The MLP width one token runs through in a target layer (what the forward's MLP transients scale with): the
    dense intermediate_size, or for MoE top_k x the expert width, plus a shared expert (Qwen3.5/3.6 MoE) and the
    dense MLP Gemma 4 runs beside its experts. GPT-OSS names its expert width intermediate_size."""
    experts, top_k = moe_experts(text)
    if not experts:
        return int(text.intermediate_size)
    width = top_k * int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    width += int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    if getattr(text, "enable_moe_block", False):  # Gemma 4: dense MLP and experts side by side
        width += int(text.intermediate_size)
    return width


def sliding_window(text) -> int:
    """The window of a target's sliding-window layers (text config), 0 when it has none."""
    types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    return int(window) if window and "sliding_attention" in types else 0


def shape_of(drafter, vocab: int, tied: bool = False, **target) -> Shape:
    """The Shape of a DFlashDraftModel on any device, meta included; `target`: the target's fields of Shape that
    online training needs (target_params, target_intermediate, ...), else none."""
    c, params = drafter.config, list(drafter.parameters())
    selector = drafter.candidate_selector
    return Shape(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                 head_dim=drafter.layers[0].self_attn.head_dim, intermediate=c.intermediate_size,
                 layers=c.num_hidden_layers, block_size=drafter.block_size, vocab=vocab,
                 target_layers=len(drafter.target_layer_ids), params=sum(p.numel() for p in params),
                 layer_params=sum(p.numel() for p in drafter.layers[0].parameters()),
                 largest_param=max(p.numel() for p in params), tied=tied,
                 layer_types=tuple(sorted(set(drafter.layer_types))), dflash2=drafter.kind == "dflash2",
                 selector_rank=selector.predecessor_codebook.shape[1] if selector is not None else 0,
                 selector_top_k=selector.top_k if selector is not None else 0, **target)


def checkpointing_of(setting) -> bool | str:
    """Setup.checkpointing for a train.gradient_checkpointing setting: auto (decided for a device) as off."""
    return setting if setting is True or setting == "selective" else False


def setup_of(target, train, loss, noise, max_length: int, world: int = 1, allowance: float = 2 * GiB,
             fragmentation: float = 0.1, optim=None) -> Setup:
    """The Setup of a configured step (the target, train, loss and noise config groups, data.max_length) on one of
    `world` processes; train.attention=auto and mixed_precision=auto are what they are on a GPU (flex, bf16);
    gradient_checkpointing=auto is off here (choose_checkpointing decides it for a device)."""
    from dflash.target.loading import DTYPES

    return Setup(ctx_len=max_length, num_anchors=train.num_anchors, batch=train.batch_size,
                 grad_accum=train.grad_accum, compute=4 if train.mixed_precision == "no" else 2,
                 frozen=DTYPES[target.dtype].itemsize, backend="sdpa" if train.attention == "sdpa" else "flex",
                 checkpointing=checkpointing_of(train.gradient_checkpointing), chunk_logits=loss.chunk_logits,
                 noise=noise.kind != "none", online=train.mode == "online", world=world,
                 distributed=train.distributed, allowance=allowance, fragmentation=fragmentation,
                 tensor_parallel=target.tensor_parallel, target_attention=target.attn_implementation,
                 foreach=optim is not None and str(optim.fused).lower() == "false")
