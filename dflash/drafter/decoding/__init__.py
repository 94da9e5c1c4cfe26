"""The speculative decoding engine: a drafter and its target in the loop.

    engine    speculative_generate (chain, DDTree, DFlash 2's selector tree) and greedy_generate
    verify    one target forward per block: a chain, a tree's paths as a batch, or a tree as one sequence
    rules     the verification rule per temperature (greedy, rejection sampling, seeded), shared by all three
    states    the target's caches after a verification: attention cropped, linear-attention states kept
    ddtree    the DDTree built from a block's per-position distributions
    sampling  temperature / top-p / top-k, the transform target and drafter share

It sits in the drafter room, below evaluate/: evaluate/ (live, walk, teacher_forced) uses it and users import
it as `dflash.decode.speculative_generate`; it imports nothing of evaluate/ or train/.
"""
