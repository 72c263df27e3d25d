"""Grammar masks and logit bias through real rounds (the real Scheduler with random AR/SPEC
routes and depths, the real RoundExecutor, every kind of drafter; the harness of
test_spec_exactness.py):

- a fake grammar over token ids shows the mask reaching every verified row of a constrained
  request, and only those, with each row masked by the state after the drafts before it;
- greedy output under a grammar equals plain AR output under it, and seeded sampled output is
  the same whatever the route; sampled output has the masked target's exact distribution;
- a JSON schema (llguidance over the tiny model's tokenizer) gives text that parses and
  validates; the matcher holds only committed tokens whatever the drafts and their fate;
- logit_bias -100 bans a token and +100 forces it, drafts proposing otherwise notwithstanding.
"""

from __future__ import annotations

import json
import zlib

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.executor.test_spec_exactness as harness
from executor.structured.grammar import GrammarCompiler
from executor.structured.slot_constraints import DeviceConstraints, SlotConstraints
from scheduler.plan import GrammarSpec, SamplingSpec, offsets
from scheduler.request import RequestSpec
from tests.executor.test_spec_exactness import (
    build_models,
    chi_square_pvalue,
    next_token_probs,
    run_requests,
    shrink_vocab,
    tiny_block_drafter,
)
from tests.fixtures.tiny_models import make_tokenizer

EOS = 0  # the tiny models' end-of-sequence token
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}
JSON_GRAMMAR = GrammarSpec("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory)


@pytest.fixture(scope="module")
def compiler(models, tmp_path_factory) -> GrammarCompiler:
    """The grammar compiler over the tiny models' tokenizer (the same BPE every tiny model
    trains on its fixed corpus)."""
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    text = (path / "tokenizer.json").read_text()
    return GrammarCompiler.from_tokenizer_json(text, models["target"].config.vocab_size, (EOS,))


@pytest.fixture
def with_compiler(monkeypatch):
    """Installs a grammar compiler in the executor every harness run builds."""

    def install(compiler) -> None:
        make = harness.make_executor

        def make_with_compiler(*args, **kwargs):
            ex = make(*args, **kwargs)
            ex.constraints.compiler = compiler
            return ex

        monkeypatch.setattr(harness, "make_executor", make_with_compiler)

    return install


# -- a fake grammar over token ids --------------------------------------------------------------
def fake_allowed(prefix: list[int], vocab: int) -> np.ndarray:
    """[vocab] bool: about a quarter of the tokens, chosen by a hash of the whole prefix."""
    key = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
    allowed = (np.arange(vocab) * 2654435761 + key) % 4 == 0
    allowed[key % vocab] = True
    return allowed


def pack(allowed: np.ndarray) -> np.ndarray:
    """[V] bool -> [ceil(V / 32)] int32 bitmask (bit t % 32 of word t // 32)."""
    width = -(-len(allowed) // 32)
    bits = np.zeros(width * 32, dtype=np.uint8)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


class FakeMatcher:
    def __init__(self, vocab: int):
        self.vocab = vocab
        self.tokens: list[int] = []

    def consume_token(self, token: int) -> bool:
        if not fake_allowed(self.tokens, self.vocab)[token]:
            return False
        self.tokens.append(token)
        return True


class FakeCompiler:
    """The compiler's face the executor uses, over the fake grammar; the masks it fills follow
    llguidance's rule (stop after a refused draft)."""

    eos_token_ids = (EOS,)

    def __init__(self, vocab: int):
        self.vocab_size = vocab

    def matcher(self, spec):
        return FakeMatcher(self.vocab_size)

    def fill_masks(self, plain, drafted, bitmask) -> None:
        for matcher, row in plain:
            bitmask[row] = pack(fake_allowed(matcher.tokens, self.vocab_size))
        for matcher, row, drafts in drafted:
            state = list(matcher.tokens)
            for j in range(len(drafts) + 1):
                allowed = fake_allowed(state, self.vocab_size)
                bitmask[row + j] = pack(allowed)
                if j == len(drafts) or not allowed[drafts[j]]:
                    break
                state.append(drafts[j])


def constrained_logit_rows(plan, constrained: set[int]) -> list[int]:
    """The logit rows of the plan's constrained requests: all rows of their decode groups and
    the row of each of their prefill chunks that samples."""
    rows, row = [], 0
    dec = plan.decode
    for i in range(len(dec)):
        k = int(dec.num_draft[i]) + 1
        if int(dec.req_ids[i]) in constrained:
            rows += range(row, row + k)
        row += k
    sampling = [q for q in plan.prefills if q.sample]
    rows += [row + j for j, q in enumerate(sampling) if q.req_id in constrained]
    return rows


def mixed_specs(rng, vocab: int, sampling_of) -> list[RequestSpec]:
    """Six requests: even ones constrained by the fake grammar, odd ones free."""
    specs = []
    for i in range(6):
        grammar = GrammarSpec("regex", "fake") if i % 2 == 0 else None
        specs.append(
            RequestSpec(
                req_id=i,
                prompt_token_ids=harness.random_prompt(rng, vocab),
                sampling=SamplingSpec(**sampling_of(i), grammar=grammar),
                max_tokens=int(rng.integers(10, 40)),
            )
        )
    return specs


@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-near", "draft-self", "block"))
def test_the_mask_reaches_every_verified_row_and_greedy_stays_ar(
    models, drafter_kind, with_compiler, monkeypatch
):
    vocab = models["target"].config.vocab_size
    with_compiler(FakeCompiler(vocab))
    applied = []
    apply = DeviceConstraints.apply

    def recording_apply(self, logits):
        out = apply(self, logits)
        applied.append((self.mask_rows.numpy().copy(), self.bitmask.numpy().copy(), logits, out))
        return out

    monkeypatch.setattr(DeviceConstraints, "apply", recording_apply)
    rng = np.random.default_rng(3)
    specs = mixed_specs(rng, vocab, lambda i: {"temperature": 0.0})
    expected_rows = []

    def on_plan(plan, sched):
        rows = constrained_logit_rows(plan, {0, 2, 4})
        if rows:
            expected_rows.append(rows)

    log = run_requests(models, specs, drafter_kind, rng, on_plan=on_plan)
    assert log.num_spec_rows > 0 and log.num_drafted > 0
    assert [r.tolist() for r, *_ in applied] == expected_rows
    for mask_rows, bitmask, logits, out in applied:
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        inside = np.zeros(len(logits), dtype=bool)
        inside[mask_rows] = True
        assert torch.equal(out[~inside], logits[~inside])  # other rows untouched
        masked = out[mask_rows]
        assert torch.equal(torch.isinf(masked), torch.from_numpy(bits == 0))
        assert torch.equal(masked[torch.from_numpy(bits == 1)], logits[mask_rows][bits == 1])
    # every token a constrained request emitted is one the grammar allowed after its prefix
    for i in (0, 2, 4):
        out = log.outputs[i]
        assert all(fake_allowed(out[:k], vocab)[t] for k, t in enumerate(out)), i
    # greedy under the grammar is plain AR under it, token for token
    reference = run_requests(models, specs, "none", np.random.default_rng(0))
    assert log.outputs == reference.outputs


def test_seeded_sampling_under_a_grammar_is_the_same_whatever_the_route(models, with_compiler):
    """Seeded requests' drafts share the target's noise (the coupled rule), so each output is
    plain decoding's under the grammar, for every drafter."""
    vocab = models["target"].config.vocab_size
    with_compiler(FakeCompiler(vocab))
    specs = mixed_specs(
        np.random.default_rng(5), vocab, lambda i: {"temperature": 0.9, "seed": 100 + i}
    )
    reference = run_requests(models, specs, "none", np.random.default_rng(0)).outputs
    for kind in ("ngram", "draft-near", "block"):
        log = run_requests(models, specs, kind, np.random.default_rng(6))
        assert log.outputs == reference, kind
        for i in (0, 2, 4):
            out = log.outputs[i]
            assert all(fake_allowed(out[:k], vocab)[t] for k, t in enumerate(out))


# -- a JSON schema through llguidance --------------------------------------------------------
def check_schema(doc) -> None:
    """Validates against SCHEMA (its few keywords, spelled out)."""
    assert isinstance(doc, dict) and set(doc) == {"name", "age", "kind", "ok"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 6
    assert type(doc["age"]) is int and 0 <= doc["age"] <= 120
    assert doc["kind"] in ("cat", "dog") and isinstance(doc["ok"], bool)


@pytest.mark.parametrize("drafter_kind", ("none", "ngram", "draft-other", "block"))
def test_a_json_schema_gives_valid_json_greedy_and_sampled(
    models, compiler, drafter_kind, with_compiler
):
    with_compiler(compiler)
    prompts = [(5, 6, 7), (9, 10, 11, 12), (3, 4), (20, 21, 22, 23, 24)]
    samplings = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.8, "seed": 4},
        {"temperature": 0.7, "top_p": 0.9},
    ]
    specs = [
        RequestSpec(
            req_id=i,
            prompt_token_ids=p,
            sampling=SamplingSpec(**samplings[i], grammar=JSON_GRAMMAR),
            max_tokens=110,
            eos_token_ids=(EOS,),
        )
        for i, p in enumerate(prompts)
    ]
    log = run_requests(models, specs, drafter_kind, np.random.default_rng(8))
    tokenizer = compiler.tokenizer
    for i in range(len(specs)):
        out = log.outputs[i]
        assert log.finish[i] == "stop" and out[-1] == EOS  # complete: only then may it end
        check_schema(json.loads(tokenizer.decode_str(out[:-1])))
    if drafter_kind != "none":
        assert log.num_drafted > 0


def mask_after(compiler, spec: GrammarSpec, tokens: list[int]) -> np.ndarray:
    """[V] bool: the tokens a fresh matcher allows after `tokens`."""
    matcher = compiler.matcher(spec)
    assert matcher.consume_tokens(tokens) or not tokens
    bitmask = llg_numpy.allocate_token_bitmask(1, compiler.vocab_size)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: compiler.vocab_size] == 1


class _Requests:
    def __init__(self, num_rows: int):
        self.slots = np.zeros(1, dtype=np.int64)
        self.num_decode = 1


class OneGroup:
    """The part of a RaggedBatch the constraints read: one decode group of `num_rows` rows."""

    def __init__(self, num_rows: int):
        self.requests = _Requests(num_rows)
        self.group_rows = offsets(np.array([num_rows]))
        self.sample_of = np.zeros(0, dtype=np.int64)
        self.num_dec_rows = num_rows


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_matcher_holds_only_the_committed_tokens(compiler, data):
    """Rounds of random drafts (valid ones, or any token) and random accept counts: each row's
    mask is the state after the drafts before it, and afterwards the matcher's state is that
    of a fresh one fed only the committed tokens."""
    vocab = compiler.vocab_size
    sc = SlotConstraints(1, vocab, torch.device("cpu"))
    sc.compiler = compiler
    sc.setup_slot(0, SamplingSpec(grammar=JSON_GRAMMAR), [])
    committed: list[int] = []
    for _ in range(data.draw(st.integers(1, 6))):
        if sc.matcher(0).is_stopped():
            break
        drafts, valid = [], 0  # the first `valid` drafts are ones the grammar allows
        for _ in range(data.draw(st.integers(0, 7))):
            reachable = valid == len(drafts) and EOS not in drafts
            allowed = mask_after(compiler, JSON_GRAMMAR, committed + drafts) if reachable else None
            if reachable and data.draw(st.booleans()):
                choices = np.flatnonzero(allowed)
                drafts.append(int(choices[data.draw(st.integers(0, len(choices) - 1))]))
            else:
                drafts.append(data.draw(st.integers(0, vocab - 1)))
            valid += int(reachable and bool(allowed[drafts[-1]]))
        input_ids = np.array([committed[-1] if committed else 1, *drafts], dtype=np.int64)
        rc = sc.round_constraints(OneGroup(len(input_ids)), input_ids)
        assert rc.mask_rows.tolist() == list(range(len(input_ids)))
        bits = np.unpackbits(rc.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for j in range(valid + 1):  # the rows reached through allowed drafts
            expected = mask_after(compiler, JSON_GRAMMAR, committed + drafts[:j])
            assert np.array_equal(bits[j] == 1, expected), j
        accepted = min(data.draw(st.integers(0, len(drafts))), valid)
        if EOS in drafts[:accepted]:  # the output ends there
            new = drafts[: drafts.index(EOS) + 1]
        else:
            choices = np.flatnonzero(bits[accepted])
            new = [*drafts[:accepted], int(choices[data.draw(st.integers(0, len(choices) - 1))])]
        sc.commit(0, new)
        committed += new
        fresh = compiler.matcher(JSON_GRAMMAR)
        assert fresh.consume_tokens(committed)
        state = sc.matcher(0)
        assert state.is_accepting() == fresh.is_accepting()
        assert state.is_stopped() == fresh.is_stopped()
        assert np.array_equal(mask_after(compiler, JSON_GRAMMAR, committed), _mask_of(state, vocab))


def _mask_of(matcher, vocab: int) -> np.ndarray:
    bitmask = llg_numpy.allocate_token_bitmask(1, vocab)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab] == 1


# -- sampled exactness under a grammar ---------------------------------------------------------
SMALL_VOCAB = 8
TINY_TOKENS = [b"<eos>", b"a", b"b", b"c", b"d", b"e", b"f", b"g"]
REGEX = GrammarSpec("regex", "[a-c][d-g]+")  # first a..c, then d..g; may end after two
NUM_SAMPLES = 3000
TEMPERATURE = 0.8
ALPHA = 1e-3


class _TinyVocab:
    eos_token_id = EOS
    bos_token_id = None
    tokens = TINY_TOKENS
    special_token_ids = (EOS,)

    def __call__(self, text: bytes) -> list[int]:
        return [TINY_TOKENS.index(bytes([c])) for c in text]


@pytest.fixture(scope="module")
def small(models, tmp_path_factory):
    small = {name: shrink_vocab(models[name], SMALL_VOCAB) for name in ("target", "draft")}
    small["block"] = tiny_block_drafter(tmp_path_factory, small["target"])
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TinyVocab()), n_vocab=8)
    return small, GrammarCompiler(tokenizer)


def masked_joint(compiler, model, prompt: list[int], num_tokens: int) -> dict:
    """Exact probability of every continuation under the grammar: the target's tempered
    distribution restricted to the allowed tokens and renormalised, token by token."""
    probs = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for prefix, p in probs.items():
            allowed = mask_after(compiler, REGEX, list(prefix))
            if compiler.matcher(REGEX).consume_tokens(list(prefix)) is False:
                continue
            dist = next_token_probs(model, prompt + list(prefix), TEMPERATURE).numpy()
            dist = np.where(allowed, dist, 0.0)
            dist /= dist.sum()
            for t in np.flatnonzero(dist):
                nxt[(*prefix, int(t))] = p * float(dist[t])
        probs = nxt
    return probs


@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-other", "block"))
def test_sampled_spec_under_a_grammar_has_the_masked_target_distribution(
    small, drafter_kind, with_compiler
):
    """Rejection sampling against the masked target: drafts the grammar forbids (the draft
    model knows nothing of it) are rejected, the others accepted as the rule says."""
    models, compiler = small
    with_compiler(compiler)
    prompt = [1, 4, 5, 1, 4, 5, 1, 4]
    specs = [
        RequestSpec(
            req_id=i,
            prompt_token_ids=tuple(prompt),
            sampling=SamplingSpec(temperature=TEMPERATURE, grammar=REGEX),
            max_tokens=3,
        )
        for i in range(NUM_SAMPLES)
    ]
    log = run_requests(
        models,
        specs,
        drafter_kind,
        np.random.default_rng(12),
        p_spec=1.0,
        max_drafts=3,
        max_slots=64,
        num_blocks=192,
        max_prefill_tokens=512,
    )
    counts: dict[tuple[int, ...], int] = {}
    for out in log.outputs.values():
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    probs = masked_joint(compiler, models["target"], prompt, 3)
    assert set(counts) <= set(probs)  # nothing outside the grammar
    pvalue, dof = chi_square_pvalue(counts, probs, NUM_SAMPLES)
    assert dof >= 20
    assert 0 < log.num_accepted < log.num_drafted
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {dof} dof"


# -- logit bias --------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-self", "block"))
def test_logit_bias_bans_and_forces_tokens_under_speculation(models, drafter_kind):
    vocab = models["target"].config.vocab_size
    rng = np.random.default_rng(9)
    prompts = [harness.random_prompt(rng, vocab) for _ in range(4)]
    plain = [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=harness.GREEDY, max_tokens=30)
        for i, p in enumerate(prompts)
    ]
    reference = run_requests(models, plain, "none", np.random.default_rng(0)).outputs
    forced = 17
    specs = []
    for i, p in enumerate(prompts):
        banned = tuple(sorted(set(reference[i])))[:300]  # everything greedy decoding emitted
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        specs.append(
            RequestSpec(
                req_id=i,
                prompt_token_ids=p,
                sampling=SamplingSpec(**sampling, logit_bias=tuple((t, -100.0) for t in banned)),
                max_tokens=30,
            )
        )
        specs.append(
            RequestSpec(
                req_id=10 + i,
                prompt_token_ids=p,
                sampling=SamplingSpec(**sampling, logit_bias=((forced, 100.0),)),
                max_tokens=30,
            )
        )
    log = run_requests(models, specs, drafter_kind, rng)
    assert log.num_drafted > 0
    for i in range(len(prompts)):
        assert not set(log.outputs[i]) & set(reference[i]), i
        assert log.outputs[10 + i] == [forced] * 30, i
