"""The online re-ranker of block-drafter candidates (`executor/drafters/rerank.py`) and its
own-start evaluation walk (`loadtests/lab/rerank_eval.py`): choices stay among the candidates,
initial weights keep the drafter's top-1, features agree with brute-force counts over the text,
the index does not depend on how text arrives, and the learner finds n-gram evidence that the
drafter misranks without hurting a drafter that is right."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from executor.drafters.rerank import OnlineReranker, TextIndex, feature_names
from loadtests.lab.rerank_eval import compare, make_toy_stream, walk

K = 4  # candidates per row in the property tests: small rows keep brute force cheap
VOCAB = 6  # a small vocabulary: n-grams recur by chance

texts = st.lists(st.integers(0, VOCAB - 1), max_size=48)


@st.composite
def repetitive_texts(draw) -> list[int]:
    """A phrase repeated with a few edits: long suffix matches, across rows too."""
    phrase = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7))
    text = phrase * draw(st.integers(2, 8))
    for _ in range(draw(st.integers(0, 3))):
        if text:
            text[draw(st.integers(0, len(text) - 1))] = draw(st.integers(0, VOCAB - 1))
    return text


property_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def random_candidates(seed: int, n: int, num_rows: int, k: int = K, vocab: int = VOCAB + 4):
    """Distinct ids per row and descending logits: [n, R, k] each."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(n * num_rows)]).reshape(
        n, num_rows, k
    )
    logits = -np.sort(rng.exponential(1.0, size=(n, num_rows, k)), axis=-1)
    return ids, logits.astype(np.float32)


def random_weights(reranker: OnlineReranker, seed: int) -> None:
    reranker.w = np.random.default_rng(seed).normal(0.0, 2.0, size=len(reranker.w))


# -- choices ------------------------------------------------------------------------------------
@property_settings
@given(
    contexts=st.lists(st.one_of(texts, repetitive_texts()), min_size=1, max_size=3),
    num_rows=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_choice_is_one_of_the_row_candidates(contexts, num_rows, seed, data):
    rr = OnlineReranker(k=K, max_walk=2)  # long matches cut short too
    random_weights(rr, seed)
    for slot, ctx in enumerate(contexts):
        rr.start(slot, ctx)
    ids, logits = random_candidates(seed, len(contexts), num_rows)
    used = data.draw(
        st.lists(st.integers(0, num_rows), min_size=len(contexts)).map(
            lambda u: (u + [num_rows] * len(contexts))[: len(contexts)]
        )
    )
    chosen = rr.rerank(list(range(len(contexts))), ids, logits, used)  # [n, R]
    assert chosen.shape == (len(contexts), num_rows)
    assert (chosen[..., None] == ids).any(axis=-1).all()
    for i, r in enumerate(used):  # padding rows keep the top-1 and are not remembered
        assert (chosen[i, r:] == ids[i, r:, 0]).all()
        assert rr.num_pending(i) == (1 if r else 0)


@property_settings
@given(
    contexts=st.lists(texts, min_size=1, max_size=3),
    num_rows=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    ties=st.booleans(),
)
@example(contexts=[[0, 0, 0, 0, 0, 0]], num_rows=3, seed=0, ties=True)
def test_initial_weights_choose_the_drafter_top1(contexts, num_rows, seed, ties):
    rr = OnlineReranker(k=K)
    for slot, ctx in enumerate(contexts):
        rr.start(slot, ctx)
    ids, logits = random_candidates(seed, len(contexts), num_rows)
    if ties:
        logits = np.round(logits)  # equal logits: the better rank still wins
    chosen = rr.rerank(list(range(len(contexts))), ids, logits)
    assert (chosen == ids[..., 0]).all()
    assert rr.stats()["top1_changed_share"] == 0.0


def occurrences(text: list[int], seq: list[int]) -> int:
    return sum(text[i : i + len(seq)] == seq for i in range(len(text) - len(seq) + 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.one_of(texts, repetitive_texts()),
    num_rows=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
@example(text=[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4], num_rows=4, seed=7)
def test_features_match_brute_force_counts(text, num_rows, seed):
    """n-gram counts and shares, and the longest suffix of context + chosen prefix that recurs
    followed by the candidate, against direct counting over the text."""
    rr = OnlineReranker(k=K, max_walk=10**6)
    random_weights(rr, seed)
    rr.w[rr.names.index("suffix_log_len")] = 3.0  # choices that follow the text: long matches
    rr.start(0, text)
    ids, logits = random_candidates(seed, 1, num_rows, vocab=VOCAB)
    chosen = rr.rerank([0], ids, logits)[0].tolist()
    x = rr.block_features(0)  # [R, k, F]
    col = {name: i for i, name in enumerate(feature_names(K))}
    for j in range(num_rows):
        prefix = text + chosen[:j]
        suffix_len = []
        for ci, c in enumerate(ids[0, j].tolist()):
            f = x[j, ci]
            for o in range(4):
                ctx = prefix[len(prefix) - o :] if o <= len(prefix) else None
                count = occurrences(text, [*ctx, c]) if ctx is not None else 0
                total = occurrences(text[:-1], ctx) if ctx is not None and o else len(text)
                assert f[col[f"ngram{o + 1}_log_count"]] == pytest.approx(math.log1p(count))
                share = count / total if count else 0.0
                assert f[col[f"ngram{o + 1}_share"]] == pytest.approx(share, rel=1e-5)
            m = 0
            while m < len(prefix) and occurrences(text, [*prefix[len(prefix) - m - 1 :], c]):
                m += 1
            suffix_len.append(m)
            assert f[col["suffix_log_len"]] == pytest.approx(math.log1p(m))
        top = max(suffix_len)
        for ci, m in enumerate(suffix_len):
            assert x[j, ci, col["suffix_longest"]] == (m == top and m >= 1)


# -- state ------------------------------------------------------------------------------------
@property_settings
@given(
    tokens=st.lists(st.integers(0, VOCAB - 1), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=8),
    window=st.integers(1, 12),
)
@example(tokens=list(range(6)) * 5, cuts=[1, 7, 25], window=4)
def test_index_state_does_not_depend_on_chunking(tokens, cuts, window):
    whole = TextIndex(window)
    whole.extend(tokens)
    chunked = TextIndex(window)
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    for a, b in itertools.pairwise(bounds):
        chunked.extend(np.array(tokens[a:b], dtype=np.int64))
    assert chunked.snapshot() == whole.snapshot()
    if tokens:
        assert whole.cur is not None and whole.cur.size >= min(len(tokens), window)
        assert whole.cur.size <= 2 * window


@property_settings
@given(
    prompt=texts,
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_training_does_not_depend_on_chunking(prompt, steps, cuts, seed):
    """Blocks proposed along the way, then the rest of the text in one extend or in pieces:
    same weights, same statistics."""
    rng = np.random.default_rng(seed)
    future = rng.integers(0, VOCAB, size=sum(steps) + 40).tolist()
    runs = []
    for chunked in (False, True):
        rr = OnlineReranker(k=K, train_batch=4, window=8)
        rr.start(0, prompt)
        pos = 0
        for i, step in enumerate(steps):
            ids, logits = random_candidates(seed + i, 1, 5)
            rr.rerank([0], ids, logits)
            rr.extend(0, future[pos : pos + step])
            pos += step
        rest = future[pos:]
        if chunked:
            bounds = [0, *sorted(c for c in cuts if c <= len(rest)), len(rest)]
            for a, b in itertools.pairwise(bounds):
                rr.extend(0, rest[a:b])
        else:
            rr.extend(0, rest)
        runs.append((rr.w.copy(), rr.stats(), rr.index(0).snapshot()))
    (w0, s0, i0), (w1, s1, i1) = runs
    np.testing.assert_array_equal(w0, w1)
    assert s0 == s1 and i0 == i1


@property_settings
@given(first=texts, second=texts, seed=st.integers(0, 2**32 - 1))
def test_release_forgets_the_slot(first, second, seed):
    rr = OnlineReranker(k=K)
    rr.start(3, first)
    ids, logits = random_candidates(seed, 1, 4)
    rr.rerank([3], ids, logits)
    rr.extend(3, [1, 2])
    rr.release(3)
    with pytest.raises(KeyError):
        rr.index(3)
    rr.start(3, second)
    fresh = OnlineReranker(k=K)
    fresh.w = rr.w.copy()
    fresh.start(3, second)
    assert rr.index(3).snapshot() == fresh.index(3).snapshot()
    assert rr.num_pending(3) == 0
    ids, logits = random_candidates(seed + 1, 1, 4)
    np.testing.assert_array_equal(rr.rerank([3], ids, logits), fresh.rerank([3], ids, logits))


def test_sync_appends_and_restarts_on_a_shorter_context():
    rr = OnlineReranker(k=K)
    rr.start(0, [1, 2, 3])
    rr.sync(0, np.array([1, 2, 3, 4, 5]))
    assert rr.index(0).text.tolist() == [1, 2, 3, 4, 5]
    rr.sync(0, [1, 2])
    assert rr.index(0).text.tolist() == [1, 2]


def test_a_block_learns_once_the_text_covers_its_rows():
    """Row j of a block proposed after L tokens predicts position L + j: the block waits for
    L + R committed tokens (several rounds), then all R rows count; release counts what the
    text covers of a block still waiting."""
    rr = OnlineReranker(k=K, train_batch=1)
    rr.start(0, [0, 1, 2, 3])
    ids, logits = random_candidates(1, 1, 5)
    truth = ids[0, :, 2].tolist()  # each row's truth is its rank-2 candidate
    rr.rerank([0], ids, logits)
    for tok in truth[:4]:
        assert rr.num_pending(0) == 1
        rr.extend(0, [tok])
    assert rr.stats()["rows_covered"] == 0
    rr.extend(0, truth[4:])
    stats = rr.stats()
    assert rr.num_pending(0) == 0
    assert stats["rows_covered"] == stats["rows_trained"] == 5
    assert stats["mean_truth_rank"] == 2.0 and stats["top1_acc"] == 0.0
    ids, logits = random_candidates(2, 1, 5)
    rr.rerank([0], ids, logits)
    rr.extend(0, [ids[0, 0, 0], ids[0, 1, 0]])
    rr.release(0)
    assert rr.stats()["rows_covered"] == 7


def test_until_miss_trains_only_rows_whose_prefix_was_right():
    rows = {}
    for mode in ("all", "until_miss"):
        rr = OnlineReranker(k=K, train_batch=1, train_rows=mode)
        rr.start(0, [0, 1, 2, 3])
        ids, logits = random_candidates(1, 1, 5)
        rr.rerank([0], ids, logits)
        rr.extend(0, [ids[0, 0, 0], ids[0, 1, 1], *ids[0, 2:, 0].tolist()])  # row 1 missed
        rows[mode] = rr.stats()["rows_trained"]
    assert rows == {"all": 5, "until_miss": 2}


# -- behaviour --------------------------------------------------------------------------------
def _accuracies(reranker: OnlineReranker, before: dict) -> tuple[float, float]:
    after = reranker.stats()
    covered = after["rows_covered"] - before.get("rows_covered", 0)
    top1 = (after["top1_correct"] - before.get("top1_correct", 0)) / covered
    chosen = (after["chosen_correct"] - before.get("chosen_correct", 0)) / covered
    return top1, chosen


def test_learns_ngram_evidence_the_drafter_misranks():
    """The truth continues an n-gram seen earlier but sits at the drafter's rank 3 on 60% of
    positions: after a warm-up text, the re-ranker's choices are right far more often than the
    drafter's top-1, and the walk gets correspondingly more tokens per verify step."""
    stream = make_toy_stream(seed=3, num_texts=4, rank_probs={3: 0.6})
    rr = OnlineReranker()
    prompts = stream.prompts()
    walk(stream.propose_block, stream.target_greedy, prompts[:1], 512, rr)  # warm-up
    before = rr.stats()
    reports = compare(stream.propose_block, stream.target_greedy, prompts[1:], 512, rr)
    top1, chosen = _accuracies(rr, before)
    assert top1 < 0.5
    assert chosen > top1 + 0.35
    on, off = reports["on"]["overall"], reports["off"]["overall"]
    assert on["tokens_per_step"] > 2.5 * off["tokens_per_step"]
    assert on["top1_changed_share"] > 0.3


def test_does_not_hurt_a_drafter_that_is_right():
    stream = make_toy_stream(seed=4, num_texts=4, rank_probs={})
    rr = OnlineReranker()
    reports = compare(stream.propose_block, stream.target_greedy, stream.prompts(), 512, rr)
    top1, chosen = _accuracies(rr, {})
    assert top1 == 1.0 and chosen >= 0.99
    on, off = reports["on"]["overall"], reports["off"]["overall"]
    assert on["tokens_per_step"] >= 0.95 * off["tokens_per_step"]
    assert on["top1_changed_share"] < 0.01


# -- the own-start walk -------------------------------------------------------------------------
BLOCK = 8  # B: B-1 draft rows and one correction / bonus token per verify step


@pytest.mark.parametrize("with_reranker", [False, True])
def test_walk_with_a_perfect_drafter_gets_a_whole_block_per_step(with_reranker):
    stream = make_toy_stream(seed=5, num_texts=2, prompt_len=32, block_rows=BLOCK - 1, k=K)
    rr = OnlineReranker(k=K) if with_reranker else None
    rep = walk(stream.propose_block, stream.target_greedy, stream.prompts(), 4 * BLOCK, rr)
    for p in [*rep["per_prompt"], rep["overall"]]:
        assert p["tokens_per_step"] == BLOCK and p["top1_changed_share"] == 0.0
    assert rep["overall"]["tokens"] == 2 * 4 * BLOCK


@pytest.mark.parametrize("with_reranker", [False, True])
def test_walk_with_a_useless_drafter_gets_one_token_per_step(with_reranker):
    stream = make_toy_stream(
        seed=6, num_texts=2, prompt_len=32, block_rows=BLOCK - 1, k=K, rank_probs={-1: 1.0}
    )
    rr = OnlineReranker(k=K) if with_reranker else None
    rep = walk(stream.propose_block, stream.target_greedy, stream.prompts(), 40, rr)
    assert rep["overall"]["tokens_per_step"] == 1.0 and rep["overall"]["steps"] == 80
    if rr is not None:
        assert rr.stats()["not_in_topk_share"] == 1.0


def test_walk_starts_each_block_after_what_it_accepted():
    """A drafter right on its first 3 rows of every block, whatever the start: each step
    accepts 3 drafts and adds the correction, so 4 tokens per step exactly; the text the walk
    produces is the target's."""
    text = np.random.default_rng(0).integers(0, 50, size=200).tolist()
    starts = []

    def propose(context):
        pos = len(context)
        starts.append(pos)
        ids = np.full((BLOCK - 1, K), 99, dtype=np.int64) + np.arange(K)  # never the truth
        ids[:3, 0] = text[pos : pos + 3]
        return ids, -np.tile(np.arange(K, dtype=np.float32), (BLOCK - 1, 1))

    def target(context, drafts):
        assert context == text[: len(context)]
        out = []
        for j, d in enumerate(drafts):
            out.append(text[len(context) + j])
            if d != out[-1]:
                return out
        return [*out, text[len(context) + len(drafts)]]

    rep = walk(propose, target, [text[:10]], 40)
    assert rep["overall"]["tokens_per_step"] == 4.0 and rep["overall"]["steps"] == 10
    assert starts == list(range(10, 50, 4))


def test_walk_rejects_a_target_that_is_not_greedy_verification():
    stream = make_toy_stream(seed=7, num_texts=1, prompt_len=16, block_rows=3, k=K)

    def bad_target(context, drafts):
        return [drafts[0] + 1, drafts[1]]  # claims an accepted draft it changed

    with pytest.raises(ValueError, match="target_greedy"):
        walk(stream.propose_block, bad_target, stream.prompts(), 8)
