"""The memory model of one training step: bytes per GPU of each part, and its peak. `python -m dflash.plan` prints
it (with the run's costs); training refuses up front a data.max_length whose step it says does not fit
(dflash.train.fit).

The drafter's dimensions come from a build on the meta device (dflash.plan.configured.shape_of); activations are
the tensors autograd saves, as model.py, attention.py, blocks.py and loss.py make them; tests/plan/test_plan.py checks
the estimate against measured peaks of real steps on CPU (tests/train/test_long_context.py at 4k tokens). Assumed:
- float32 parameters, gradients and AdamW moments; under bf16 autocast (train.mixed_precision auto/bf16,
  the GPU default) linear layers and attention compute in bfloat16, the rest in float32; the features
  arrive on the device in their stored dtype and are upcast there, so the residual stream is float32;
- autocast casts each float32 weight to bfloat16 once per forward and autograd keeps the cast for the
  weight's backward: a bf16 copy of every weight from its forward until its layer's backward, under DDP
  and FSDP alike (dflash/train/fit.py counts the same copies as FSDP's "gathered weights");
- offline, the target's frozen embed_tokens and lm_head on the GPU in target.dtype (twice unless tied);
  online, the whole target in target.dtype instead (the drafter borrows the target's own embed_tokens and
  lm_head, so they are not counted again), and its no-grad forward's working set as a phase of its own;
  nothing [L, L] in it (right padding takes no mask: dflash.target.features) but for a target with sliding-window
  layers under sdpa, for which transformers builds a dense bool [1, 1, L, L] mask once a sequence reaches the
  window, and torch's sdpa a copy of it in the target's dtype for each layer's call (eager attention, GPT-OSS's,
  is not modelled: its [b, heads, L, L] scores are the attention itself);
- every sequence has data.max_length tokens and train.num_anchors blocks (the padded shape; flex pads
  the context to a multiple of 256); flex attention saves its output and log-sum-exp, no scores; the sdpa
  path (CPU) saves per chunk of blocks the keys, values and float mask it sees, anchors spread evenly, and
  keeps the chunks' bool masks (one set per layer type) through forward and backward;
- flex keeps one BlockMask per layer type through the step (int32 tile lists, packed_block_mask); the
  temporaries that build it are freed before the forward, so they never set the peak;
- gradient checkpointing (true: full) keeps each layer's input and recomputes one layer at a time in backward;
  selective checkpointing (dflash.drafter.recompute) keeps each layer's input and the outputs of its matmuls and
  attention (`selective_outputs`), and recomputes the rest of one layer at a time;
- DDP (world_size > 1) keeps a second copy of the gradients in its buckets;
- FSDP (world_size > 1) is what dflash/train/accel.py sets up: FSDP2, each decoder layer its own unit and
  the rest (fc, the norms) the root unit, MixedPrecisionPolicy() (float32 parameters and reductions).
  Each rank keeps 1/world of the float32 parameters, gradients and AdamW state. The root's float32
  parameters stay gathered from its forward to its backward (FSDP2 does not reshard the root after
  forward); a layer's are gathered for its forward and again for its backward, the next layer's
  prefetched meanwhile (two layers at a time); in backward a layer's unsharded float32 gradients and the
  reduce-scatter's input copy of them are alive until the reduce-scatter. With train.grad_accum > 1 the
  micro-batches before the last run under no_sync, where FSDP2 keeps the whole unsharded gradients;
- the peak is the largest of five phases: the online target's forward, the loss backward (all activations
  and a chunk of logits), the drafter layers (a layer's forward or backward working set on top), the end of
  backward (all gradients) and the optimizer step (AdamW fused on CUDA by default, optim.fused: a tensor's
  temporaries at a time; its foreach path, optim.fused=false, a temporary the size of the parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dflash.tiling import BLOCKS_PER_CHUNK_TOKENS, FLEX_TILE, flex_padded_shape

GiB = 2**30
MODES = {"no checkpointing": False, "selective checkpointing": "selective", "checkpointing": True}
"""The plan's names of train.gradient_checkpointing's values (Setup.checkpointing), from the most memory to the
least."""
MODE_WORDS = {False: "off", "selective": "selective", True: "full"}
"""A train.gradient_checkpointing value in one word, as the plan's GPU table and the benchmarks name it."""


@dataclass
class Shape:
    """The drafter and target dimensions the estimate needs (`shape_of` reads them off a drafter)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    block_size: int
    vocab: int
    target_layers: int  # feeding fc: the features are target_layers x hidden wide
    params: int
    layer_params: int
    largest_param: int
    tied: bool = False  # the target ties embed_tokens and lm_head (one frozen matrix)
    target_params: int = 0  # the whole causal LM (tied weights once): what online training keeps on the GPU
    layer_types: tuple[str, ...] = ("full_attention",)  # distinct drafter layer types: one attention mask each
    target_intermediate: int = 0  # the target's MLP width a token runs through (MoE: its experts'): forward working set
    target_active_params: int = 0  # of target_params, what a token runs through (MoE: its top-k experts); 0 = all
    target_largest: tuple[int, ...] = ()  # elements of the target's largest tensors, largest first (loading)
    target_window: int = 0  # the sliding window of the target's sliding-window layers (0: it has none)
    dflash2: bool = False  # DFlash 2: two grouped dynamic convolutions per layer (their weights are in params)
    selector_rank: int = 0  # DFlash 2's selector: codebooks [vocab, rank] (in params, FSDP's root unit)
    selector_top_k: int = 0

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (fc, hidden_norm, norm): FSDP's root unit."""
        return self.params - self.layers * self.layer_params

    @property
    def heads_params(self) -> int:
        """The target's embed_tokens and lm_head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)


@dataclass
class Setup:
    """One micro-batch on one GPU; sizes in tokens, dtypes in bytes per element."""

    ctx_len: int
    num_anchors: int
    batch: int = 1
    grad_accum: int = 1  # > 1: the gradients of earlier micro-batches stay through forward and backward
    compute: int = 2  # linear and attention activations: 2 under bf16 autocast, 4 without
    frozen: int = 2  # the frozen target weights (target.dtype)
    backend: str = "flex"
    checkpointing: bool | str = False  # a value of MODES: False, "selective" or True (full)
    chunk_logits: int = 134217728
    noise: bool = False
    online: bool = False
    world: int = 1
    distributed: str = "ddp"
    tensor_parallel: int = 1  # the target sharded over this many GPUs (Shape.target_params is then one GPU's share)
    target_attention: str = "sdpa"  # target.attn_implementation: sdpa builds dense sliding-window masks
    foreach: bool = False  # AdamW's foreach path (optim.fused=false on CUDA): a temporary the size of the parameters
    allowance: float = 2 * GiB
    fragmentation: float = 0.1

    @property
    def sharded(self) -> bool:
        """FSDP actually shards (on one process accelerate trains unsharded, as DDP would)."""
        return self.distributed == "fsdp" and self.world > 1


def sdpa_mask_bytes(s: Shape, u: Setup) -> int:
    """Bytes of the masks the sdpa path keeps (dflash.drafter.packed_attention.chunked_mask) for one sequence and
    one kind of layer, the anchors spread evenly over [0, ctx_len - 2]: per chunk of blocks an additive float32
    context mask up to its largest anchor and a flag per query, and a bool [B, B] per block."""
    n, size = u.num_anchors, s.block_size
    per, held = max(1, BLOCKS_PER_CHUNK_TOKENS // size), n * size * size
    for first in range(0, n, per):
        last = min(n, first + per)
        ctx = round((last - 1) * (u.ctx_len - 2) / max(n - 1, 1))  # the chunk's largest anchor
        held += (last - first) * size * (4 * ctx + 1) if ctx else 0
    return held


DENSE_MASK_BYTES = {"full_attention": 3, "sliding_attention": 20}
"""Peak bytes per [query, key] entry of create_block_mask's dense build (CPU, torch 2.13, as TensorPeak
counts; tests/plan/test_plan.py measures it): what a flex mask cost to build before packed_block_mask."""
BUILD_BYTES = 16  # peak bytes per [query, key tile] entry of packed_block_mask's temporaries (4 x int32)


def flex_padded(u: Setup) -> Setup:
    """The Setup at the shapes draft_packed pads flex batches to (the context to a multiple of 256)."""
    return replace(u, ctx_len=flex_padded_shape(u.ctx_len, u.num_anchors, u.num_anchors)[0])


def block_mask_bytes(s: Shape, u: Setup) -> dict[str, int]:
    """Bytes of a micro-batch's flex BlockMasks, one per layer type, at the padded shape. kept: their int32
    tensors, kv_num_blocks [b, 1, q_tiles] and kv_indices [b, 1, q_tiles, kv_tiles], the pair for full
    tiles, and the q-side transposes of both ([b, 1, kv_tiles], [b, 1, kv_tiles, q_tiles]); build: the
    temporaries packed_block_mask makes for one; dense before: what create_block_mask held for all."""
    u = flex_padded(u)
    q = u.num_anchors * s.block_size
    q_tiles, kv_tiles = -(-q // FLEX_TILE), -(-(u.ctx_len + q) // FLEX_TILE)
    per_mask = 2 * 4 * (q_tiles + kv_tiles + 2 * q_tiles * kv_tiles)
    return {"kept": u.batch * len(s.layer_types) * per_mask,
            "build": u.batch * BUILD_BYTES * q_tiles * FLEX_TILE * kv_tiles,
            "dense before": u.batch * q * (u.ctx_len + q) * sum(DENSE_MASK_BYTES[t] for t in s.layer_types)}


def _layer_sizes(s: Shape, u: Setup) -> tuple[int, int, int, int, int]:
    """(bytes of the compute dtype, a layer's query tokens, its key tokens, the query and the key-value widths)."""
    q, k = u.batch * u.num_anchors * s.block_size, u.batch * (u.ctx_len + u.num_anchors * s.block_size)
    return u.compute, q, k, s.heads * s.head_dim, s.kv_heads * s.head_dim


def layer_activations(s: Shape, u: Setup) -> float:
    """Bytes one drafter layer saves for backward. An RMSNorm keeps its float32 input and normalised
    output; a tensor feeding n linear layers is kept once in float32, or as n bf16 casts under autocast."""
    a, q, k, hq, hkv = _layer_sizes(s, u)
    fed = lambda n: 4 if a == 4 else n * a
    total = q * s.hidden * (16 + fed(1) + fed(2))  # input_layernorm (-> q_proj), post_attention_layernorm (-> gate, up)
    total += k * s.hidden * fed(2)  # cat(context, block) -> k_proj, v_proj
    total += q * hq * (4 + 4 * a) + q * s.heads * 4  # q_norm's input, normalised and rotated q, output, o_proj input
    total += q * s.intermediate * 4 * a  # gate, silu, up, their product
    if s.dflash2:  # per convolution: its projection's input cast, the taps (a quarter of H, kept in the sublayer's
        # dtype), and around the sublayer its output (attention's o_proj, the MLP's down_proj), which nothing else
        # keeps; the normed inputs the convolutions keep are the norms' own outputs
        total += 2 * q * s.hidden * (2 * a + (4 + a) / 8)
    total += k * hkv * (4 + 3 * a)  # k_norm's input, normalised and rotated k; v
    if u.backend == "sdpa" and a < 4:  # the split attention's inputs in the autocast dtype (rotary leaves q, k float32)
        total += (q * hq + k * hkv) * a
    return total


def selective_outputs(s: Shape, u: Setup) -> float:
    """Bytes of the outputs selective checkpointing keeps for one drafter layer (dflash.drafter.recompute.SAVED),
    in the compute dtype: its linear layers' (q, k, v, o, gate, up, down; DFlash 2's two tap projections), and
    attention's output and float32 log-sum-exp; on the sdpa path also the own-block scores and values."""
    a, q, k, hq, hkv = _layer_sizes(s, u)
    total = q * (hq + 2 * s.hidden + 2 * s.intermediate) * a + 2 * k * hkv * a  # q, o, down, gate, up; k, v
    total += q * hq * a + q * s.heads * 4  # attention's output and log-sum-exp
    if u.backend == "sdpa":  # the own-block bmm's: scores [q, B] per head, and their product with the values
        total += q * s.heads * (s.block_size + s.head_dim) * a
    if s.dflash2:  # the two convolutions' tap projections, [q, 2 k H / group size] each: a quarter of H at the
        total += 2 * q * s.hidden // 4 * a  # published k = 2 and groups of 16, as layer_activations takes them
    return total


def replayed_as_saved(s: Shape, u: Setup) -> float:
    """Bytes of one layer's activations (layer_activations) that are outputs selective checkpointing kept: its
    replay in backward gets them back instead of making them again. v and the MLP's gate and up; without autocast
    also q and k as their norms' inputs (autocast casts them to float32 first), and flex attention's output (the
    sdpa path merges its parts after the saved ops)."""
    a, q, k, hq, hkv = _layer_sizes(s, u)
    total = k * hkv * a + 2 * q * s.intermediate * a
    if a == 4:
        total += q * hq * 4 + k * hkv * 4
    if u.backend == "flex":
        total += q * hq * a
    return total


def state_terms(s: Shape, u: Setup) -> dict[str, float]:
    """Bytes per GPU of the drafter's weights and training state and of the frozen target weights."""
    shard = u.world if u.sharded else 1
    P, Lp, R = s.params, s.layer_params, s.root_params
    return {
        "drafter parameters (fp32)": P * 4 / shard,
        "gradients (fp32)": P * 4 / shard,
        "AdamW state (2 x fp32)": 2 * P * 4 / shard,
        "DDP gradient buckets": P * 4 if u.world > 1 and u.distributed == "ddp" else 0,
        # the root unit for the whole forward and backward, one layer and the prefetched next
        "FSDP gathered parameters (fp32)": (R + 2 * Lp) * 4 if u.sharded else 0,
        # a layer's unsharded gradients and the reduce-scatter's input, in backward
        "FSDP gradients before reduce-scatter": 2 * Lp * 4 if u.sharded else 0,
        # earlier micro-batches' gradients: DDP's own, FSDP2's unsharded ones under no_sync
        "gradients kept between micro-batches": P * 4 if u.grad_accum > 1 else 0,
        "autocast weight copies (bf16)": P * u.compute if u.compute < 4 else 0,
        "frozen embed + lm_head": 0 if u.online else s.heads_params * u.frozen,
        "target model (online)": s.target_params * u.frozen if u.online else 0,
    }


def breakdown(s: Shape, u: Setup) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per GPU of each part of a training step, and how the activations change in backward."""
    if u.backend == "flex":  # the shapes draft_packed pads to
        u = flex_padded(u)
    a, b, H, V, I = u.compute, u.batch, s.hidden, s.vocab, s.intermediate
    q, c, k = b * u.num_anchors * s.block_size, b * u.ctx_len, b * (u.ctx_len + u.num_anchors * s.block_size)
    rows = b * u.num_anchors * (s.block_size - 1)  # labelled slots: what goes through lm_head
    chunk_rows = min(rows, max(1, u.chunk_logits // V)) if u.chunk_logits else rows
    shard = u.world if u.sharded else 1
    t = state_terms(s, u)
    t["feature batch (fp32)"] = c * s.target_layers * H * 4 * (2 if u.noise else 1)
    t["flex block masks"] = block_mask_bytes(s, u)["kept"] if u.backend == "flex" else 0
    # the sdpa path's ChunkedMask for each kind of layer, built before the forward and held until the backward is done
    kinds = len(set(s.layer_types))
    t["sdpa chunk masks"] = b * sdpa_mask_bytes(s, u) * kinds if u.backend == "sdpa" else 0
    # online, before the drafter's forward: the captured layers' outputs in target.dtype and one target
    # layer's transients (its MLP's gate, up and product; the residual, norm and attention outputs)
    f = u.frozen
    t["target forward working set (online)"] = c * (s.target_layers * H * f + (3 * s.target_intermediate
                                                                               + 4 * H) * f) if u.online else 0
    # transformers' bool [1, 1, L, L] sliding-window mask (sdpa, from the window on: below it the layer is causal),
    # and sdpa's copy of it in the target's dtype, [b, 1, L, L], during each layer's call
    dense = u.online and u.target_attention == "sdpa" and 0 < s.target_window <= u.ctx_len
    t["target sliding-window mask (online)"] = u.ctx_len ** 2 * (1 + b * f) if dense else 0
    per_layer = layer_activations(s, u)
    # the final norm's input and normalised output, the rows fed to lm_head, an unchunked log-softmax:
    # all freed before the layers' backward
    loss_side = q * H * 8 + rows * H * 4 + (rows * V * 4 if chunk_rows == rows else 0)
    if s.selector_rank:  # DFlash 2's selector per labelled row: the candidates' successor codes and the predecessor's
        # (compute dtype, as the product casts them), the projection's input cast and output, the unary top-K
        r, K = s.selector_rank, s.selector_top_k
        loss_side += rows * ((K + 2) * r * a + H * a + K * 12)
    # fc's bf16 input, hidden_norm's input and output, rotary cos/sin, the final norm's output (the result)
    outer = c * s.target_layers * H * (a if a < 4 else 0) + c * H * (4 + a) + 2 * k * s.head_dim * 4
    outer += q * H * 4 + loss_side
    # layer 0 keeps no input (frozen embeddings need no gradient); checkpointing keeps the layers' inputs
    # and the context (selective: and each layer's matmul and attention outputs), and recomputes one layer's
    # activations (but its input) at a time
    saved = selective_outputs(s, u)
    t["activations, no checkpointing"] = outer + s.layers * per_layer - q * H * 4
    t["activations, selective checkpointing"] = outer + s.layers * (q * H * 4 + saved) + c * H * 4
    t["activations, checkpointing"] = outer + s.layers * q * H * 4 + c * H * 4
    t["recomputed layer (checkpointing)"] = per_layer - q * H * 4
    t["recomputed layer (selective)"] = per_layer - q * H * 4 - replayed_as_saved(s, u)
    # a loss chunk: its float32 log-softmax, its gradient, the logits' (when chunked, made in the forward with
    # loss.fused_ce, else recomputed in backward: measured within 2% of each other on test_plan.py's chunked shapes)
    t["loss logits buffer"] = chunk_rows * V * (12 if chunk_rows < rows else 8)
    # DFlash 2: the codebooks' dense gradients as the embedding backward makes them, before accumulation
    t["loss logits buffer"] += 2 * V * s.selector_rank * 4
    # a layer's forward: rotary temporaries of q and k, the float32 cat(context, block)
    t["layer forward working set"] = 8 * (q * s.heads + k * s.kv_heads) * s.head_dim + 4 * k * H
    # a layer's backward: the MLP's gradients in flight, down_proj's weight gradient, the residual's gradient
    t["layer backward working set"] = 2 * q * I * a + H * I * 4 + q * H * 4
    t["optimizer step temporaries"] = (s.params / shard if u.foreach else 2 * s.largest_param) * 4
    # going down the layers, backward leaves each one's weight gradients (sharded under FSDP) and frees what
    # it saved (with checkpointing: its input only) and its bf16 weight copies, while the context's gradient
    # builds up
    kept = {False: per_layer, "selective": q * H * 4 + saved, True: q * H * 4}[u.checkpointing]
    copies = s.layer_params * a if a < 4 else 0
    lower = max(0, (s.layers - 1) * (s.layer_params * 4 / shard - kept - copies) + c * H * 4)
    return t, {"loss side": loss_side, "lower layers": lower}


def terms(s: Shape, u: Setup) -> dict[str, float]:
    """Bytes per GPU of each part of a training step (the module docstring says what is assumed)."""
    return breakdown(s, u)[0]


PERSISTENT = ("drafter parameters (fp32)", "AdamW state (2 x fp32)", "DDP gradient buckets", "frozen embed + lm_head",
              "target model (online)", "feature batch (fp32)", "flex block masks")


def phases(s: Shape, u: Setup) -> dict[str, float]:
    """Bytes per GPU of each phase of the step on top of the PERSISTENT terms."""
    t, change = breakdown(s, u)
    acts = t[f"activations, {mode_name(u.checkpointing)}"]
    layer = {False: 0, "selective": t["recomputed layer (selective)"],
             True: t["recomputed layer (checkpointing)"]}[u.checkpointing]
    # held through forward and backward: the compute-dtype weight copies, FSDP's gathered units, earlier
    # micro-batches' gradients, the sdpa path's masks
    held = t["FSDP gathered parameters (fp32)"] + t["autocast weight copies (bf16)"]
    held += t["gradients kept between micro-batches"] + t["sdpa chunk masks"]
    working = max(t["layer forward working set"], t["layer backward working set"])
    root = s.root_params * 4 if u.sharded else 0  # FSDP: the root's gathered weights and its unsharded gradients
    return {
        "target forward (online)": (t["target forward working set (online)"] + t["target sliding-window mask (online)"]
                                    + t["gradients kept between micro-batches"]),
        "loss backward": acts + held + t["loss logits buffer"],
        "drafter layers": (acts - change["loss side"] + layer + held + working + change["lower layers"]
                           + t["FSDP gradients before reduce-scatter"]),
        # DDP accumulates into the same gradients; FSDP2 adds the sharded ones to its unsharded accumulation
        "end of backward": (t["gradients (fp32)"] + 3 * root
                            + (t["gradients kept between micro-batches"] if u.sharded else 0)),
        "optimizer step": t["gradients (fp32)"] + t["optimizer step temporaries"],
    }


BACKWARD = ("target forward (online)", "loss backward", "drafter layers", "end of backward")
"""The phases before the optimizer step: the forward and backward, whose peak the activations set."""


def peak(s: Shape, u: Setup, among: tuple[str, ...] | None = None) -> tuple[float, str]:
    """Peak bytes per GPU (with the allowance and fragmentation) and the phase that sets it; `among`: over those
    phases only (BACKWARD: the peak of the forward and backward, which the GPU check measures on its own: the
    optimizer step's 20 bytes a parameter set the whole step's peak and would hide the activations)."""
    t, by_phase = terms(s, u), phases(s, u)
    by_phase = {k: v for k, v in by_phase.items() if among is None or k in among}
    phase = max(by_phase, key=by_phase.get)
    total = sum(t[k] for k in PERSISTENT) + by_phase[phase]
    return total * (1 + u.fragmentation) + u.allowance, phase


def mode_name(mode) -> str:
    """The plan's name (a key of MODES) of a train.gradient_checkpointing value."""
    return next(name for name, value in MODES.items() if value == mode and type(value) is type(mode))


def choose_checkpointing(s: Shape, u: Setup, budget: float | None) -> tuple[bool | str, str]:
    """What train.gradient_checkpointing=auto chooses for a device of `budget` bytes (None: not a CUDA device): the
    first of MODES (none, selective, full) whose step's peak (with the fragmentation and allowance as margin) fits,
    full where none does; off on CPU, so CPU runs compute as before. Returns (the value, the reason in words, with
    the peaks)."""
    if budget is None:
        return False, "off (not a CUDA device)"
    peaks = {mode: peak(s, replace(u, checkpointing=mode))[0] for mode in MODES.values()}
    figures = (f"planned peak {peaks[False] / GiB:.1f} GiB without it, {peaks['selective'] / GiB:.1f} GiB selective, "
               f"{peaks[True] / GiB:.1f} GiB full; the device has {budget / GiB:.1f} GiB")
    if peaks[False] <= budget:
        return False, f"off: the step fits without it ({figures})"
    if peaks["selective"] <= budget:
        return "selective", f"selective: the step fits keeping its layers' matmul outputs ({figures})"
    return True, f"true (full): the step does not fit with less ({figures})"


def max_anchors(s: Shape, u: Setup, budget: float) -> int:
    """The largest num_anchors whose peak fits `budget` bytes (0 if none). Memory grows linearly with
    the anchors but for the loss chunk's cap, so a bisection finds it."""
    fits = lambda n: peak(s, replace(u, num_anchors=n))[0] <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
