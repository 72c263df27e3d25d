"""Batched sampling on the device: penalties, temperature / top-k / top-p / min-p, seeded draws
and logprobs for all rows of a round at once. Nothing here reads a tensor back to the host, so a
round costs no host-device synchronisation until the caller copies the sampled ids out.

Per row, in this order (the same for AR rows, spec rows and rejection sampling):
1. `apply_logit_bias`, then `apply_token_bitmask` (a grammar's mask), then `apply_penalties`
   (repetition, then frequency and presence), on the raw logits;
2. greedy rows (temperature 0) take the argmax of the penalised logits;
3. `process_logits`: temperature, top-k, top-p (after top-k), min-p, softmax;
4. `sample_from_probs`: an exponential race on the counter-based generator of `executor/rng.py`.
`compute_logprobs` reports the distribution after penalties, before temperature and filtering.

Per-row parameters travel in one packed layout (`FLOAT_PARAMS`, `INT_PARAMS`): the slot table
holds it, `PackedSampling` gathers a batch's rows, `SamplingTensors.from_packed` reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor import rng
from executor.rng import Stream
from scheduler.plan import SamplingSpec

_NEG_INF = float("-inf")

# The packed layout: one float32 row per name of FLOAT_PARAMS and one int64 row per name of
# INT_PARAMS, in these orders; the names are the fields of `SamplingTensors` they become.
FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
INT_PARAMS = ("top_k", "seed", "step")


def has_penalties(spec: SamplingSpec) -> bool:
    """Whether the request's logits are penalised (its output counts must then be kept)."""
    return (
        spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
        or spec.repetition_penalty != 1.0
    )


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling parameters as a row of the packed layout holds them."""

    floats: tuple[float, ...]  # in FLOAT_PARAMS order, the temperature clamped at 0
    top_k: int  # the vocab size when off
    seed: int  # int64: the request's own seed, or one derived from the base seed and its req_id


def sampling_row(spec: SamplingSpec, req_id: int, base_seed: int, vocab_size: int) -> SamplingRow:
    floats = (
        max(spec.temperature, 0.0),
        spec.top_p,
        spec.min_p,
        spec.presence_penalty,
        spec.frequency_penalty,
        spec.repetition_penalty,
    )
    top_k = spec.top_k if 0 < spec.top_k < vocab_size else vocab_size
    seed = rng.derive_seed(base_seed, req_id) if spec.seed is None else spec.seed
    return SamplingRow(floats, top_k, rng.seed_to_int64(seed))


@dataclass(frozen=True)
class PackedSampling:
    """The sampling parameters of N rows on the host, in the packed layout."""

    floats: np.ndarray  # [len(FLOAT_PARAMS), N] float32; greedy rows hold temperature 1.0
    ints: np.ndarray  # [len(INT_PARAMS), N] int64
    greedy: np.ndarray  # [N] bool
    penalised: np.ndarray  # [N] bool

    @classmethod
    def pack(cls, floats, greedy, top_k, seed, step, penalised) -> PackedSampling:
        """floats [len(FLOAT_PARAMS), N] (the temperature row as the requests give it), the
        others [N]. Greedy rows divide by 1.0 so that the division stays finite."""
        greedy = np.asarray(greedy, dtype=bool)
        floats = np.array(floats, dtype=np.float32).reshape(len(FLOAT_PARAMS), len(greedy))
        floats[0] = np.where(greedy, np.float32(1.0), floats[0])
        ints = np.stack([np.asarray(x, dtype=np.int64).reshape(-1) for x in (top_k, seed, step)])
        return cls(floats, ints, greedy, np.asarray(penalised, dtype=bool))

    @property
    def sampled_rows(self) -> np.ndarray:
        """[M] int64 rows with temperature > 0."""
        return np.flatnonzero(~self.greedy)

    @property
    def mixed(self) -> bool:
        """Some rows are greedy and some sample."""
        return 0 < len(self.sampled_rows) < len(self.greedy)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one round, on the device, plus host-side facts about the
    whole batch (known without a sync) that let the sampler skip work no row needs."""

    temperature: torch.Tensor  # [N] float32; greedy rows hold 1.0 so divisions stay finite
    top_p: torch.Tensor  # [N] float32 in (0, 1]
    min_p: torch.Tensor  # [N] float32 in [0, 1]
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32, 1.0: off
    top_k: torch.Tensor  # [N] int64, vocab size when off
    seed: torch.Tensor  # [N] int64, the request's own seed or one derived from its req_id
    step: torch.Tensor  # [N] int64, per-request counter of the token each row samples
    greedy: torch.Tensor  # [N] bool
    sampled_rows: torch.Tensor | None  # [M] int64 rows with temperature > 0; None unless mixed
    num_rows: int
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_penalties: bool
    max_top_k: int  # largest top-k of any row that uses one

    @classmethod
    def from_packed(
        cls,
        packed: PackedSampling,  # the rows on the host
        float_rows: torch.Tensor,  # [len(FLOAT_PARAMS), N] float32: packed.floats on the device
        int_rows: torch.Tensor,  # [len(INT_PARAMS), N] int64: packed.ints on the device
        greedy: torch.Tensor,  # [N] bool: packed.greedy on the device
        sampled_rows: torch.Tensor | None,  # [M] packed.sampled_rows on the device, when mixed
        vocab_size: int,
    ) -> SamplingTensors:
        """The fields as views of the uploaded rows; the batch facts from the host copy."""
        sampled = ~packed.greedy  # [N]
        top_k = packed.ints[0]
        top_ks = top_k[sampled & (top_k < vocab_size)]  # rows that sample with a top-k
        return cls(
            **dict(zip(FLOAT_PARAMS, float_rows)),
            **dict(zip(INT_PARAMS, int_rows)),
            greedy=greedy,
            sampled_rows=sampled_rows,
            num_rows=len(sampled),
            all_greedy=not sampled.any(),
            any_greedy=bool(packed.greedy.any()),
            use_top_k=len(top_ks) > 0,
            use_top_p=bool((packed.floats[1, sampled] < 1.0).any()),
            use_min_p=bool((packed.floats[2, sampled] > 0.0).any()),
            use_penalties=bool(packed.penalised.any()),
            max_top_k=int(top_ks.max(initial=0)),
        )

    @classmethod
    def build(
        cls,
        specs: Sequence[SamplingSpec],
        req_ids: Sequence[int],
        steps: Sequence[int],
        *,
        vocab_size: int,
        base_seed: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """One row per entry. `vocab_size` is the width of the logits (the model's, which may
        exceed the tokenizer's). `steps[i]` must differ between the tokens one request samples
        (its sequence position does). Rows of a request without a seed draw from
        `rng.derive_seed(base_seed, req_id)`. Call `rng.prepare(device, vocab_size)` once before
        capturing CUDA graphs that contain sampling."""
        num_rows = len(specs)
        if not len(req_ids) == len(steps) == num_rows:
            raise ValueError("specs, req_ids and steps need one entry per row")
        rows = [sampling_row(s, r, base_seed, vocab_size) for s, r in zip(specs, req_ids)]
        floats = np.array([r.floats for r in rows], dtype=np.float32)
        packed = PackedSampling.pack(
            floats.reshape(num_rows, len(FLOAT_PARAMS)).T,
            [s.greedy for s in specs],
            [r.top_k for r in rows],
            [r.seed for r in rows],
            list(steps),
            [has_penalties(s) for s in specs],
        )

        def upload(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        return cls.from_packed(
            packed,
            upload(packed.floats),
            upload(packed.ints),
            upload(packed.greedy),
            upload(packed.sampled_rows) if packed.mixed else None,
            vocab_size,
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The sampling rows `rows` [M] int64 that are not greedy (as `sampled_rows`)."""
        return dataclasses.replace(
            self,
            **{name: getattr(self, name).index_select(0, rows) for name in _ROW_FIELDS},
            sampled_rows=None,
            num_rows=rows.shape[0],
            all_greedy=False,
            any_greedy=False,
        )


_ROW_FIELDS = (*FLOAT_PARAMS, *INT_PARAMS, "greedy")


# -- penalties ---------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,
    st: SamplingTensors,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
) -> torch.Tensor:
    """logits [N, V] float32, output_counts [N, V] int (occurrences of each token in the row's
    output so far), prompt_mask [N, V] bool -> penalised logits [N, V] float32 (a new tensor;
    the input itself when no row has a penalty).

    vLLM / OpenAI semantics: a token seen in the prompt or the output has its logit divided by
    the repetition penalty r when positive and multiplied by r when negative; then
    `logit -= frequency * count_in_output + presence * (count_in_output > 0)`."""
    if not st.use_penalties:
        return logits
    counts = output_counts.to(logits.dtype)  # [N, V]
    seen = prompt_mask | (output_counts > 0)  # [N, V]
    rep = st.repetition_penalty[:, None]  # [N, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    out = out - st.frequency_penalty[:, None] * counts
    return out - st.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)


def update_output_counts(
    counts: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """In place: counts [S, V] int += one per emitted token. slots [M] int64, token_ids [M, T]
    int64 padded with -1 (padding adds nothing)."""
    vocab = counts.shape[1]
    valid = token_ids >= 0  # [M, T]
    flat = slots[:, None] * vocab + token_ids.clamp(min=0)  # [M, T]
    counts.view(-1).scatter_add_(0, flat.reshape(-1), valid.reshape(-1).to(counts.dtype))


def mark_tokens(mask: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place: mask[slot, token] = True for the listed tokens (e.g. a prompt at slot setup).
    mask [S, V] bool, slots [M] int64, token_ids [M, T] int64 padded with -1."""
    vocab = mask.shape[1]
    valid = token_ids >= 0  # [M, T]
    flat = slots[:, None] * vocab + token_ids.clamp(min=0)  # [M, T]
    # amax with 0 for padding leaves whatever the padding index already holds.
    mask.view(torch.uint8).view(-1).scatter_reduce_(
        0, flat.reshape(-1), valid.reshape(-1).to(torch.uint8), "amax"
    )


def clear_slots(table: torch.Tensor, slots: torch.Tensor) -> None:
    """In place: zero the rows of released slots in a per-slot count or mask table [S, V]."""
    table.index_fill_(0, slots, 0)


def gather_row_counts(
    counts: torch.Tensor, row_slots: torch.Tensor, preceding_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row output counts [N, V] from the per-slot table counts [S, V]. row_slots [N] int64.
    preceding_ids [N, D] int64 (-1 padded): tokens that count as output for that row only, such
    as the drafts before a speculative row, which would be outputs if accepted."""
    rows = counts.index_select(0, row_slots)  # [N, V]
    if preceding_ids is not None and preceding_ids.numel():
        valid = preceding_ids >= 0  # [N, D]
        rows.scatter_add_(1, preceding_ids.clamp(min=0), valid.to(rows.dtype))
    return rows


# -- constraints (logit bias, grammar masks) ---------------------------------------------------


def apply_logit_bias(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """logits [L, V] -> logits [L, V] (a new tensor) with `values` [K] added at (rows [K],
    token_ids [K]): OpenAI's logit_bias, on the raw logits."""
    return logits.index_put((rows, token_ids), values.to(logits.dtype), accumulate=True)


_BYTE_MASKS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_masks(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row b holds 0 where bit k of byte b is set and -inf where it is not."""
    table = _BYTE_MASKS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, _NEG_INF).to(device)
        _BYTE_MASKS[(device, dtype)] = table
    return table


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """logits [L, V] -> logits [L, V] (a new tensor) whose rows `rows` [G] keep only the tokens
    their bitmask [G, ceil(V / 32)] int32 allows (bit t % 32 of word t // 32, little-endian:
    the layout llguidance and xgrammar fill), the others at -inf.

    Each mask byte looks up its 8 additive terms (0 or -inf) in a [256, 8] table, and the terms
    are added to the rows: a gather and an add, where unpacking the bits and filling the
    logits takes several times longer on a CPU. Adding 0 leaves a logit as it was."""
    num, vocab = bitmask.shape[0], logits.shape[-1]
    table = _byte_masks(logits.device, logits.dtype)
    mask_bytes = bitmask.view(torch.uint8).long()  # [G, 4 W]: byte t // 8 holds token t
    terms = torch.nn.functional.embedding(mask_bytes, table).view(num, -1)[:, :vocab]  # [G, V]
    return logits.index_add(0, rows, terms)


# -- distributions -----------------------------------------------------------------------------


def _filter_logits(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Top-k, then top-p, then min-p, as -inf masks on temperature-scaled logits [N, V]: keep
    the k largest logits, then the smallest set of tokens whose probability reaches top-p, then
    drop tokens whose probability is below min-p times the largest one."""
    vocab = scaled.shape[-1]
    if st.use_top_k:
        k = min(st.max_top_k, vocab)
        top_vals = torch.topk(scaled, k, dim=-1).values  # [N, k], descending
        kth = top_vals.gather(1, (st.top_k.clamp(max=k) - 1)[:, None])  # [N, 1]
        keep_all = (st.top_k >= vocab)[:, None]  # [N, 1]: rows without top-k
        scaled = scaled.masked_fill(~keep_all & (scaled < kth), _NEG_INF)
    if st.use_top_p:
        sorted_vals, order = scaled.sort(dim=-1, descending=True)  # [N, V]
        sorted_probs = sorted_vals.softmax(dim=-1)  # [N, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V], exclusive
        # Keep a token while the mass of the better ones is still short of top_p; the best
        # token is always kept. Rows with top_p == 1 keep everything despite rounding.
        drop_sorted = (mass_before >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, _NEG_INF)
    if st.use_min_p:
        # p_v >= min_p * p_max  <=>  logit_v >= logit_max + log(min_p); min_p = 0 keeps all.
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(st.min_p)[:, None]  # [N, 1]
        scaled = scaled.masked_fill(scaled < floor, _NEG_INF)
    return scaled


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits, dtype=torch.float32)  # [N, V]
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def process_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Penalised logits [N, V] -> the distribution each row samples from, probs [N, V] float32
    (rows sum to 1; greedy rows are a one-hot of their argmax)."""
    logits = logits.float()
    if st.all_greedy:
        return _one_hot_argmax(logits)
    scaled = _filter_logits(logits / st.temperature[:, None], st)  # [N, V]
    probs = scaled.softmax(dim=-1)  # [N, V]
    if st.any_greedy:
        probs = torch.where(st.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def sample_from_probs(
    probs: torch.Tensor, st: SamplingTensors, stream: int = Stream.SAMPLE
) -> torch.Tensor:
    """probs [N, V] (non-negative, rows need not be normalised) -> token ids [N] int64.

    argmax_v p_v / E_v with independent E_v ~ Exp(1) picks v with probability p_v / sum(p)
    (the minimum of independent exponentials with rates p_v is attained at v with that
    probability). Tokens with p_v = 0 never win; a row without any mass returns token 0, so a
    caller drawing from a residual that may be empty must handle that row itself."""
    race = rng.exponentials(st.seed, st.step, stream, probs.shape[-1])  # [N, V]
    return (probs / race).argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Penalised logits [N, V] -> token ids [N] int64: argmax for greedy rows, a seeded draw
    from `process_logits` for the others."""
    greedy_ids = logits.argmax(dim=-1)  # [N]
    if st.all_greedy:
        return greedy_ids
    if st.sampled_rows is None:  # no greedy rows
        return sample_from_probs(process_logits(logits, st), st)
    # Mixed batch: the race over the vocabulary only for the rows that need it.
    sub = st.select(st.sampled_rows)
    sampled_ids = sample_from_probs(process_logits(logits[st.sampled_rows], sub), sub)  # [M]
    return greedy_ids.index_copy(0, st.sampled_rows, sampled_ids)


def uniforms(st: SamplingTensors, num: int, stream: int = Stream.ACCEPT) -> torch.Tensor:
    """[N, num] float32 in (0, 1) from each row's (seed, step): e.g. the acceptance tests of
    rejection sampling. Independent of the numbers `sample` uses (another stream)."""
    return rng.uniforms(st.seed, st.step, stream, num)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Penalised logits [N, V], token_ids [N] -> (chosen_logprob [N] float32,
    top_ids [N, k] int64, top_logprobs [N, k] float32), best first.

    These are log-probabilities of the model's distribution after penalties, before temperature,
    top-k, top-p and min-p: the quantity OpenAI's API reports, comparable across requests with
    different sampling settings. k = 0 gives empty [N, 0] tensors."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logprobs.gather(1, token_ids.long()[:, None])[:, 0]  # [N]
    if k <= 0:
        empty = logprobs.new_empty((logprobs.shape[0], 0))
        return chosen, empty.long(), empty
    top_logprobs, top_ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_logprobs
