from dflash.target.toy_measure import repeated_ngram_fraction


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction(list(range(50))) == 0.0
    assert repeated_ngram_fraction([1, 2, 3] * 30) > 0.9
    assert repeated_ngram_fraction([1, 2]) == 0.0
