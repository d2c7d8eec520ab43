"""The n-gram baselines of the char-LM experiment: interpolated Witten-Bell probabilities are
distributions, give unseen characters mass, match a hand computation, and score the same
validation targets as the models."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from linattn_lib.experiments import ngram
from linattn_lib.experiments.charlm import CharData, build_corpus
from linattn_lib.experiments.ngram import WittenBellLM, bits_per_char


@pytest.fixture(scope="module")
def data():
    return CharData(build_corpus())


def test_toy_corpus_matches_the_hand_computation():
    """Train "aab" over the vocabulary {a, b, c}. Unigram: c(a) = 2, c(b) = 1, N = 3, N1+ = 2
    distinct characters, p(w) = (c(w) + 2/3) / 5. Bigram after "a": c(a, a) = c(a, b) = 1,
    c(a) = 2, N1+(a) = 2, p(w | a) = (c(a, w) + 2 p(w)) / 4. "b" is never a context: the
    unigram."""
    lm1 = WittenBellLM(1, 3).fit([0, 0, 1])
    lm2 = WittenBellLM(2, 3).fit([0, 0, 1])
    uni = [Fraction(8, 15), Fraction(1, 3), Fraction(2, 15)]
    after_a = [Fraction(31, 60), Fraction(25, 60), Fraction(4, 60)]
    np.testing.assert_allclose(lm1.distribution([]), [float(f) for f in uni], rtol=1e-12)
    np.testing.assert_allclose(lm1.distribution([1]), [float(f) for f in uni], rtol=1e-12)
    np.testing.assert_allclose(lm2.distribution([0]), [float(f) for f in after_a], rtol=1e-12)
    np.testing.assert_allclose(lm2.distribution([1]), [float(f) for f in uni], rtol=1e-12)
    np.testing.assert_allclose(lm2.distribution([2, 1]), [float(f) for f in uni], rtol=1e-12)


def test_distributions_sum_to_one_and_unseen_characters_get_mass(data):
    train = data.train.numpy()
    lm = WittenBellLM(5, data.vocab_size).fit(train)
    unseen = sorted(set(range(data.vocab_size)) - set(np.unique(train).tolist()))
    for context in ("", "e", "Return", "the ", "zqx#", "    ", "\n\n"):
        p = lm.distribution(data.encode(context).numpy())
        assert p.shape == (data.vocab_size,) and abs(p.sum() - 1) < 1e-12, context
        assert (p > 0).all(), context
        assert all(p[u] > 0 for u in unseen)
    # after "Retur" the 5-gram is confident: "n" takes most of the mass
    p = lm.distribution(data.encode("Retur").numpy())
    assert p.argmax() == data.stoi["n"] and p.max() > 0.9


def test_scores_the_models_targets(data):
    """bits_per_char scores val[1 : n*ctx + 1], the targets of charlm.validation_loss; the
    unigram does not depend on the context, so both context modes give the same number."""
    lm = WittenBellLM(1, data.vocab_size).fit(data.train.numpy())
    ctx = 64
    _, y = data.val_windows(ctx)
    p = lm.distribution([])
    expected = -np.log2(p[y.flatten().numpy()]).mean()
    for window in (False, True):
        assert abs(bits_per_char(lm, data.val.numpy(), ctx, window_context=window) - expected) < 1e-12


def test_window_context_is_cut_at_the_window_start():
    """In "aab aab ..." the character after "a" needs two characters of context. In window
    mode the first target of every window sees only the "a" that opens the window: about
    one bit there, so about 1/ctx bit more on average than with the stream's context."""
    train = np.array([0, 0, 1] * 200)
    val = np.array([0, 0, 1] * 20)
    lm = WittenBellLM(3, 2).fit(train)
    stream = bits_per_char(lm, val, 6)
    window = bits_per_char(lm, val, 6, window_context=True)
    assert stream < 0.05 and abs(window - stream - 1 / 6) < 0.03
    # with ctx = 1 every target sees exactly one character: the bigram's score
    bigram = WittenBellLM(2, 2).fit(train)
    assert abs(bits_per_char(lm, val, 1, window_context=True) - bits_per_char(bigram, val, 1)) < 1e-12


def test_five_gram_beats_the_bigram_on_the_real_split(data):
    res = ngram.baselines(data.train.numpy(), data.val.numpy(), data.vocab_size, [64], orders=(1, 2, 5))
    bpc = {n: res["orders"][str(n)]["stream"]["64"] for n in (1, 2, 5)}
    assert bpc[5] < bpc[2] - 1.0 < bpc[1] - 1.5
    assert bpc[1] < np.log2(data.vocab_size)
    assert res["orders"]["5"]["window"]["64"] >= bpc[5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="order"):
        WittenBellLM(0, 10)
    with pytest.raises(ValueError, match="order"):
        WittenBellLM(ngram.MAX_ORDER + 1, 10)
    lm = WittenBellLM(2, 3)
    with pytest.raises(RuntimeError, match="fit"):
        lm.distribution([0])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 3\)"):
        lm.fit([0, 3])
    with pytest.raises(ValueError, match="no window"):
        bits_per_char(lm.fit([0, 1, 2]), torch.tensor([0, 1]).numpy(), 4)
