"""The hybrid (Qwen3.5 dense) forward against transformers, its config parsing, and the state
journal: tiny random checkpoints, fp32, CPU.

The forward is driven directly here, with hand-made block tables and its own state slots;
`test_hybrid_rounds.py` runs it through the scheduler and the round executor.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.delta_rule import chunk_gated_delta_rule_ref, recurrent_step
from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import AttnMetadata
from executor.model_config import ModelLoadError, load_model_config
from executor.recurrent_state import RecurrentStates
from tests.executor.tiny_qwen3_5 import as_multimodal_layout, make_tiny_qwen3_5

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # as test_model_vs_hf.py: fp32 on both sides, different reduction orders
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=0)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_logits(model_dir, model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    seqs = [
        torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (150, 40)
    ]
    with torch.no_grad():
        return seqs, [hf(torch.tensor([s])).logits[0] for s in seqs]


class Runner:
    """Model.forward over hand-made, scattered block tables, one state slot per sequence (on
    the model's device; logits come back on the host)."""

    def __init__(self, model, num_seqs: int, max_len: int = 256):
        self.model = model
        per_seq = max_len // BLOCK
        self.kv = KVCache.for_model(model, num_blocks=num_seqs * per_seq + 1, block_size=BLOCK)
        perm = torch.randperm(num_seqs * per_seq, generator=torch.Generator().manual_seed(1))
        self.tables = (perm + 1).view(num_seqs, per_seq).to(torch.int32)
        self.states = RecurrentStates.for_model(model, num_seqs + 1)
        self.slot_of = np.arange(num_seqs) + 1  # slot 0 stays idle: slots need not be seqs
        for s in self.slot_of:
            self.states.setup(int(s))
        self.lens = [0] * num_seqs
        self.round_id = 0

    def run(self, chunks: dict[int, list[int]], drafts: dict[int, int] | None = None):
        """chunks: seq -> new rows; `drafts`: seq -> its rows journal instead (a SPEC group
        with that many drafts; its length is not advanced). Returns per seq logits."""
        drafts = drafts or {}
        ids, pos, slots, cu, seq_lens, seqs = [], [], [], [0], [], []
        for s, toks in chunks.items():
            start = self.lens[s]
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(int(self.tables[s, p // BLOCK]) * BLOCK + p % BLOCK)
            cu.append(len(ids))
            seq_lens.append(start + len(toks))
            seqs.append(s)
            if s not in drafts:
                self.lens[s] += len(toks)
        dev = self.model.device
        meta = AttnMetadata(
            positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=self.tables[seqs].to(dev),
        )
        self.round_id += 1
        rs = self.states.begin_round(
            self.round_id,
            self.slot_of[seqs],
            np.array(cu),
            np.array([drafts.get(s, 0) for s in seqs]),
        )
        with torch.no_grad():
            ids_dev = torch.tensor(ids, device=dev)
            hidden = self.model.forward(ids_dev, meta, self.kv.k, self.kv.v, states=rs)
            logits = self.model.logits(hidden).cpu()
        return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]

    def commit(self, seqs: list[int], accepted: list[int]) -> None:
        """Commits the last round's journaled groups of `seqs` at `accepted` drafts."""
        self.states.commit(self.round_id, np.ones(len(seqs), bool), np.array(accepted))
        for s, a in zip(seqs, accepted):
            self.lens[s] += a + 1


def test_prefill_in_chunks_and_decode_match_transformers(model, hf_logits):
    (ids, _), (ref, _) = hf_logits
    torch.testing.assert_close(Runner(model, 1).run({0: ids})[0], ref, atol=ATOL, rtol=0)
    # chunks straddle the delta rule's 64-row chunks and the KV blocks; then AR rows
    r = Runner(model, 1)
    got = [r.run({0: ids[:13]})[0], r.run({0: ids[13:90]})[0]]
    got += [r.run({0: [t]})[0] for t in ids[90:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_ragged_round_mixes_chunk_ar_row_and_journaled_group(model, hf_logits):
    (a, b), (ref_a, ref_b) = hf_logits
    r = Runner(model, 2)
    r.run({0: a[:70], 1: b[:20]})
    # one forward: a journaled 6-row group for seq 0, an AR row then a chunk for seq 1
    out = r.run({0: a[70:76], 1: b[20:21]}, drafts={0: 5})
    torch.testing.assert_close(out[0], ref_a[70:76], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], ref_b[20:21], atol=ATOL, rtol=0)
    r.commit([0], [2])  # seq 0 keeps 3 of its rows
    out = r.run({0: a[73:80], 1: b[21:40]})
    torch.testing.assert_close(out[0], ref_a[73:80], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], ref_b[21:40], atol=ATOL, rtol=0)


def test_released_multimodal_layout_serves_its_text_model(model_dir, model, tmp_path, hf_logits):
    mm = load_model(as_multimodal_layout(model_dir, tmp_path / "mm"), dtype="float32")
    assert mm.config.layer_types == model.config.layer_types
    assert mm.num_params == model.num_params  # vision and MTP tensors were never read
    (_, ids), (_, ref) = hf_logits
    torch.testing.assert_close(Runner(mm, 1).run({0: ids})[0], ref, atol=ATOL, rtol=0)


def _edited(model_dir, tmp_path, **fields):
    path = tmp_path / "edited"
    shutil.copytree(model_dir, path)
    raw = json.loads((path / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_config_defaults_follow_transformers(model_dir, tmp_path):
    raw = json.loads((model_dir / "config.json").read_text())
    params = {k: v for k, v in raw["rope_parameters"].items() if k != "partial_rotary_factor"}
    cfg = load_model_config(
        _edited(
            model_dir,
            tmp_path,
            layer_types=None,
            full_attention_interval=2,
            rope_parameters=params,
            num_hidden_layers=5,
        )
    )
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2 + ("linear_attention",)
    assert cfg.linear_layer_ids == (0, 2, 4)
    assert cfg.rope.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    assert cfg.attn_output_gate and cfg.linear_attn.conv_dim == 2 * 2 * 16 + 4 * 8


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8}, "num_experts=8"),
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"attn_output_gate": False}, "attn_output_gate=False"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(model_dir, tmp_path, fields, message):
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model_config(_edited(model_dir, tmp_path, **fields))
    assert "\n" not in str(err.value)


def test_a_cached_prefix_is_refused_at_setup(model):
    states = RecurrentStates.for_model(model, 2)
    with pytest.raises(ValueError, match="prefix caching off"):
        states.setup(0, num_cached_tokens=16)
    assert states.num_free == 2
    allocated = sum(t.numel() * t.element_size() for t in (states.conv, states.ssm))
    assert allocated == 2 * RecurrentStates.bytes_per_slot(model.config, dtype_bytes=4)


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 100),
    chunk=st.sampled_from([1, 4, 16, 64]),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_chunked_delta_rule_equals_the_recurrence(length, chunk, heads, seed):
    g = torch.Generator().manual_seed(seed)
    dk, dv = 8, 4
    q = torch.randn(length, heads, dk, generator=g) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 2
    beta = torch.rand(length, heads, generator=g)
    s0 = torch.randn(heads, dk, dv, generator=g)
    out, final = chunk_gated_delta_rule_ref(q, k, v, decay, beta, s0, chunk_size=chunk)
    state = s0[None].clone()
    rows = [recurrent_step(state, q[t, None], k[t, None], v[t, None], decay[t, None], beta[t, None])
            for t in range(length)]  # fmt: skip
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, state[0], atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    num_draft=st.integers(1, 7),
    data=st.data(),
)
def test_journal_commit_selects_the_state_after_each_accepted_length(
    model, hf_logits, prompt_len, num_draft, data
):
    """Verifying 1 + d rows and committing j drafts leaves exactly the state that feeding
    rows 0..j one by one leaves, for every j in 0..d; rejected rows leave no trace."""
    accepted = data.draw(st.integers(0, num_draft), label="accepted")
    (ids, _), _ = hf_logits
    rows = ids[prompt_len : prompt_len + num_draft + 1]
    spec, ar = Runner(model, 1), Runner(model, 1)
    for r in (spec, ar):
        r.run({0: ids[:prompt_len]})
    spec.run({0: rows}, drafts={0: num_draft})
    spec.commit([0], [accepted])
    for t in rows[: accepted + 1]:
        ar.run({0: [t]})
    # equal up to the GEMMs blocking 1 + d rows otherwise than one
    torch.testing.assert_close(spec.states.conv, ar.states.conv, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(spec.states.ssm, ar.states.ssm, atol=1e-5, rtol=1e-5)
    nxt = ids[prompt_len + accepted + 1 : prompt_len + accepted + 3]
    torch.testing.assert_close(spec.run({0: nxt})[0], ar.run({0: nxt})[0], atol=ATOL, rtol=0)


@pytest.mark.gpu
def test_on_gpu_chunks_ar_rows_and_a_committed_group_match_transformers(model_dir, hf_logits):
    """The same checkpoint on CUDA: the Triton ops and the fused delta-rule kernels (verify
    rows and the journal's replay at commit) against transformers on the CPU."""
    model = load_model(model_dir, dtype="float32", device="cuda")
    assert model.device.type == "cuda"
    (a, b), (ref_a, ref_b) = hf_logits
    r = Runner(model, 2)
    r.run({0: a[:70], 1: b[:20]})
    out = r.run({0: a[70:76], 1: b[20:21]}, drafts={0: 5})
    tol = dict(atol=2e-3, rtol=0)  # TF32 products in the GPU's attention and GEMMs
    torch.testing.assert_close(out[0], ref_a[70:76], **tol)
    torch.testing.assert_close(out[1], ref_b[20:21], **tol)
    r.commit([0], [2])
    out = r.run({0: a[73:80], 1: b[21:40]})
    torch.testing.assert_close(out[0], ref_a[73:80], **tol)
    torch.testing.assert_close(out[1], ref_b[21:40], **tol)
    for t in range(80, 90):
        torch.testing.assert_close(r.run({0: [a[t]]})[0], ref_a[t : t + 1], **tol)
