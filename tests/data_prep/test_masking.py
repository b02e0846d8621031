"""ALBERT n-gram MLM masking (data_prep/masking.py): budget, 80/10/10, n-gram law, whole words."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep.masking import (
    IGNORE_INDEX,
    MaskingConfig,
    mask_example,
    masking_budget,
    random_non_special_ids,
    word_start_table,
)

VOCAB = 1000
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL_IDS = np.array([PAD, UNK, CLS, SEP, MASK])


def synthetic(rng: np.random.Generator, len_a: int, len_b: int, pad: int = 0, p_word: float = 0.6):
    """[CLS] A [SEP] B [SEP] <pad>*: ids, special mask, word starts (random, p_word per token)."""
    body = lambda n: rng.integers(5, VOCAB, size=n)  # noqa: E731
    ids = np.concatenate([[CLS], body(len_a), [SEP], body(len_b), [SEP], np.full(pad, PAD)])
    special = np.isin(ids, SPECIAL_IDS)
    word_start = rng.random(len(ids)) < p_word
    return ids.astype(np.int64), special, word_start


def run(cfg: MaskingConfig, ids, special, word_start, seed: int):
    return mask_example(
        ids, special, word_start, np.random.default_rng(seed), cfg, VOCAB, MASK, SPECIAL_IDS
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mlm_probability": 0.0},
        {"mlm_probability": 1.5},
        {"mask_token_fraction": 0.7},  # sums to 0.9
        {"mask_token_fraction": 1.2, "random_token_fraction": -0.1, "keep_fraction": -0.1},
        {"max_ngram": 0},
        {"max_ngram": 2.5},
        {"whole_word": "yes"},
        {"sop_probability": 1.1},
        {"static_masked_positions": 0},
        {"static_masked_positions": True},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        MaskingConfig(**kwargs)


def test_ngram_probabilities_are_one_over_n():
    np.testing.assert_allclose(MaskingConfig().ngram_probabilities(), [6 / 11, 3 / 11, 2 / 11])


def test_budget_is_round_half_up_at_least_one():
    cfg = MaskingConfig()
    assert masking_budget(0, cfg) == 0
    assert masking_budget(1, cfg) == 1
    assert masking_budget(10, cfg) == 2  # 1.5 -> 2 (Python's round would give 2 too)
    assert masking_budget(30, cfg) == 5  # 4.5 -> 5 (banker's rounding would give 4)
    assert masking_budget(125, cfg) == 19  # 18.75
    assert masking_budget(125, MaskingConfig(static_masked_positions=7)) == 7


def test_budget_exact_and_80_10_10_split_token_level():
    """Token spans: every example predicts exactly its budget; the replacement split is 80/10/10."""
    cfg = MaskingConfig(whole_word=False)
    rng = np.random.default_rng(0)
    kinds = np.zeros(3)
    for seed in range(1500):
        la, lb = rng.integers(1, 70, size=2)
        ids, special, ws = synthetic(rng, la, lb, pad=int(rng.integers(0, 5)))
        m = run(cfg, ids, special, ws, seed)
        picked = m.labels != IGNORE_INDEX
        assert picked.sum() == masking_budget(int((~special).sum()), cfg)
        assert not picked[special].any()
        np.testing.assert_array_equal(m.input_ids[special], ids[special])  # specials untouched
        np.testing.assert_array_equal(m.input_ids[~picked], ids[~picked])  # only picks change
        np.testing.assert_array_equal(m.labels[picked], ids[picked])
        got = m.input_ids[picked]
        is_mask = got == MASK
        is_keep = got == ids[picked]
        kinds += [is_mask.sum(), (~is_mask & ~is_keep).sum(), is_keep.sum()]
        replaced = got[~is_mask & ~is_keep]
        assert not np.isin(replaced, SPECIAL_IDS).any() and (replaced < VOCAB).all()
    frac = kinds / kinds.sum()
    assert kinds.sum() > 15_000
    # Random draws equal the original with p 1/995: "keep" is 0.1 + 0.1/995.
    np.testing.assert_allclose(frac, [0.8, 0.1, 0.1], atol=0.012)


def test_overall_rate_is_fifteen_percent():
    cfg = MaskingConfig(whole_word=True)
    rng = np.random.default_rng(1)
    predicted = real = 0
    for seed in range(600):
        ids, special, ws = synthetic(rng, 60, 63)
        m = run(cfg, ids, special, ws, seed)
        predicted += int((m.labels != IGNORE_INDEX).sum())
        real += int((~special).sum())
    assert abs(predicted / real - 0.15) < 0.005


def test_ngram_length_distribution_is_one_over_n():
    """At low density (overlaps and the budget's end are rare) the accepted span lengths follow
    P(n) ~ 1/n: 6/11, 3/11, 2/11."""
    cfg = MaskingConfig(mlm_probability=0.02, whole_word=False)
    rng = np.random.default_rng(2)
    counts = np.zeros(4)
    for seed in range(300):
        ids, special, ws = synthetic(rng, 1500, 1500)
        m = run(cfg, ids, special, ws, seed)
        for start, n in m.spans:
            counts[n] += 1
            assert (m.labels[start : start + n] != IGNORE_INDEX).all()  # n tokens from start
    frac = counts[1:] / counts.sum()
    assert counts.sum() > 8000
    np.testing.assert_allclose(frac, [6 / 11, 3 / 11, 2 / 11], atol=0.015)

    # At the default 15% of 125 tokens, overlaps skip long spans more often and the last span is
    # shortened to fit the budget (as in ALBERT): measured about (0.60, 0.25, 0.15).
    cfg = MaskingConfig(whole_word=False)
    counts[:] = 0
    for seed in range(400):
        ids, special, ws = synthetic(rng, 60, 63)
        for _, n in run(cfg, ids, special, ws, seed).spans:
            counts[n] += 1
    frac = counts[1:] / counts.sum()
    assert frac[0] > frac[1] > frac[2] > 0.1
    np.testing.assert_allclose(frac, [6 / 11, 3 / 11, 2 / 11], atol=0.08)


def test_max_ngram_one_gives_single_tokens():
    cfg = MaskingConfig(max_ngram=1, whole_word=False)
    ids, special, ws = synthetic(np.random.default_rng(3), 100, 100)
    m = run(cfg, ids, special, ws, 0)
    assert {n for _, n in m.spans} == {1}


def word_ids(special: np.ndarray, word_start: np.ndarray) -> np.ndarray:
    """Word number of each token (-1 at specials); a word never crosses a special token."""
    starts = word_start | np.r_[True, special[:-1]]
    wid = np.cumsum(starts & ~special) - 1
    return np.where(special, -1, wid)


def test_whole_word_spans_never_cut_a_word():
    cfg = MaskingConfig(whole_word=True)
    rng = np.random.default_rng(4)
    ratio = []
    for seed in range(800):
        ids, special, ws = synthetic(rng, *rng.integers(5, 70, size=2), p_word=0.5)
        m = run(cfg, ids, special, ws, seed)
        picked = m.labels != IGNORE_INDEX
        assert not picked[special].any()
        wid = word_ids(special, ws)
        for w in np.unique(wid[wid >= 0]):
            in_word = picked[wid == w]
            assert in_word.all() or not in_word.any(), f"word {w} partly masked"
        for start, n in m.spans:  # a span starts at a word start and covers n whole words
            assert ws[start] or special[start - 1]
            assert 1 <= n <= 3
        budget = masking_budget(int((~special).sum()), cfg)
        assert picked.sum() <= budget
        ratio.append(picked.sum() / budget)
    assert np.mean(ratio) > 0.97  # ends under budget only when no remaining word fits


def test_spans_stay_inside_their_segment():
    cfg = MaskingConfig(mlm_probability=0.5, whole_word=False)
    rng = np.random.default_rng(5)
    for seed in range(300):
        ids, special, ws = synthetic(rng, 3, 3)
        m = run(cfg, ids, special, ws, seed)
        for start, n in m.spans:
            assert not special[start : start + n].any()


def test_static_masked_positions_count_is_exact():
    rng = np.random.default_rng(6)
    for k in (5, 40):
        cfg = MaskingConfig(static_masked_positions=k)
        for seed in range(200):
            ids, special, ws = synthetic(rng, *rng.integers(1, 70, size=2), pad=3)
            m = run(cfg, ids, special, ws, seed)
            assert m.masked_positions.shape == m.masked_weights.shape == (k,)
            assert m.masked_labels.shape == (k,)
            picked = np.flatnonzero(m.labels != IGNORE_INDEX)
            count = int(m.masked_weights.sum())
            assert count == len(picked) <= k
            if k == 5:  # the budget (>= 5 real tokens here... mostly) is capped at k
                assert count == min(5, masking_budget(int((~special).sum()), MaskingConfig()))
            np.testing.assert_array_equal(m.masked_positions[:count], picked)
            np.testing.assert_array_equal(m.masked_labels[:count], ids[picked])
            assert (m.masked_positions[count:] == 0).all()
            assert (m.masked_labels[count:] == IGNORE_INDEX).all()
            assert (m.masked_weights[count:] == 0).all()


def test_no_real_tokens_and_one_real_token():
    cfg = MaskingConfig()
    ids = np.array([CLS, SEP, SEP, PAD])
    special = np.ones(4, dtype=bool)
    m = mask_example(ids, special, special, np.random.default_rng(0), cfg, VOCAB, MASK, SPECIAL_IDS)
    assert (m.labels == IGNORE_INDEX).all() and m.spans == []
    ids = np.array([CLS, 77, SEP, SEP])
    special = np.array([True, False, True, True])
    m = mask_example(
        ids, special, ~special, np.random.default_rng(0), cfg, VOCAB, MASK, SPECIAL_IDS
    )
    assert m.labels.tolist() == [IGNORE_INDEX, 77, IGNORE_INDEX, IGNORE_INDEX]


def test_pure_and_deterministic():
    ids, special, ws = synthetic(np.random.default_rng(7), 50, 50)
    before = ids.copy(), special.copy(), ws.copy()
    a = run(MaskingConfig(), ids, special, ws, 11)
    b = run(MaskingConfig(), ids, special, ws, 11)
    c = run(MaskingConfig(), ids, special, ws, 12)
    for x, y in zip(before, (ids, special, ws)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.labels, c.labels)


def test_random_ids_are_uniform_over_non_special():
    specials = np.array([0, 5, 6, 11])
    draws = random_non_special_ids(np.random.default_rng(0), 60_000, 12, specials)
    counts = np.bincount(draws, minlength=12)
    assert (counts[specials] == 0).all()
    regular = np.setdiff1d(np.arange(12), specials)
    np.testing.assert_allclose(counts[regular] / 60_000, 1 / 8, atol=0.006)


def _tokenizer(vocab: list[str], wordpiece: bool = False):
    from tokenizers import Tokenizer, models

    table = {t: i for i, t in enumerate(vocab)}
    model = (
        models.WordPiece(table, unk_token="<unk>")
        if wordpiece
        else models.WordLevel(table, unk_token="<unk>")
    )
    tok = Tokenizer(model)
    tok.add_special_tokens(["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"])
    return tok


def test_word_start_table_sentencepiece_and_wordpiece():
    specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
    sp = _tokenizer([*specials, "▁the", "s", "▁cat", "ing", ","])
    assert word_start_table(sp).tolist() == [True] * 5 + [True, False, True, False, False]
    wp = _tokenizer([*specials, "the", "##s", "cat", "##ing", ","], wordpiece=True)
    assert word_start_table(wp).tolist() == [True] * 5 + [True, False, True, False, True]
    with pytest.raises(ValueError, match="whole_word=False"):
        word_start_table(_tokenizer([*specials, "the", "s"]))
