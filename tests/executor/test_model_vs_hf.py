"""The ragged paged forward against transformers on tiny random checkpoints (fp32, CPU).

Tolerance: both sides compute in fp32 with the same operation order up to GEMM blocking and
softmax reductions, so logits agree to ~1e-5 absolute on values of magnitude ~3; we allow 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import AttnMetadata
from executor.model_config import ModelLoadError
from tests.fixtures.tiny_models import ARCHS, make_tiny_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {a: make_tiny_model(tmp_path_factory.mktemp(a), a, seed=i) for i, a in enumerate(ARCHS)}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class PagedRunner:
    """Drives Model.forward directly with hand-made block tables (scattered block ids)."""

    def __init__(self, model, num_seqs, max_len=256):
        self.model = model
        blocks_per_seq = max_len // BLOCK
        self.kv = KVCache.allocate(
            model.config,
            num_blocks=num_seqs * blocks_per_seq + 3,
            block_size=BLOCK,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        perm = torch.randperm(num_seqs * blocks_per_seq, generator=torch.Generator().manual_seed(1))
        self.tables = (perm + 3).view(num_seqs, blocks_per_seq).to(torch.int32)
        self.lens = [0] * num_seqs

    def run(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """chunks: seq -> new token ids. Returns per seq logits [len(chunk), vocab]."""
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
            self.lens[s] += len(toks)
        meta = AttnMetadata(
            positions=torch.tensor(pos),
            slot_mapping=torch.tensor(slots),
            cu_q_lens=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.tables[seqs],
        )
        logits = self.model.logits(
            self.model.forward(torch.tensor(ids), meta, self.kv.k, self.kv.v)
        )
        return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunked_and_decode_match_transformers(model_dirs, arch):
    model = load_model(model_dirs[arch], dtype="float32")
    hf = _hf(model_dirs[arch])
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [70, vocab]
    # one-shot prefill
    full = PagedRunner(model, 1).run({0: ids})[0]
    torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
    # chunked prefill (chunks straddle block boundaries) then single-token decode across blocks
    r = PagedRunner(model, 1)
    got = r.run({0: ids[:13]})[0]
    got = torch.cat([got, r.run({0: ids[13:40]})[0]])
    for t in ids[40:]:
        got = torch.cat([got, r.run({0: [t]})[0]])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_ragged_batch_mixes_prefill_decode_and_multirow(model_dirs):
    model = load_model(model_dirs["qwen3"], dtype="float32")
    hf = _hf(model_dirs["qwen3"])
    g = torch.Generator().manual_seed(3)
    seqs = [
        torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 25, 33)
    ]
    r = PagedRunner(model, 3)
    r.run({0: seqs[0][:30], 1: seqs[1][:20], 2: seqs[2][:17]})
    # one forward: seq 0 gets a 10-row group, seq 1 a single AR row, seq 2 a 16-row chunk
    out = r.run({0: seqs[0][30:], 1: seqs[1][20:21], 2: seqs[2][17:]})
    with torch.no_grad():
        for s, (lo, hi) in zip(range(3), ((30, 40), (20, 21), (17, 33))):
            ref = hf(torch.tensor([seqs[s][:hi]])).logits[0, lo:hi]
            torch.testing.assert_close(out[s], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    path = make_tiny_model(tmp_path, "llama", rope_parameters={"rope_theta": 10000.0, **rope})
    model = load_model(path, dtype="float32")
    assert model.config.rope.rope_type == rope["rope_type"]
    ids = torch.randint(0, model.config.vocab_size, (150,)).tolist()
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(PagedRunner(model, 1).run({0: ids})[0], ref, atol=ATOL, rtol=0)


def test_tied_embeddings(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True)
    model = load_model(path, dtype="float32")
    assert model.weights.lm_head is model.weights.embed
    ids = list(range(1, 30))
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(PagedRunner(model, 1).run({0: ids})[0], ref, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path, model_dirs):
    hf = _hf(model_dirs["llama"])
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((model_dirs["llama"] / name).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = load_model(tmp_path, dtype="float32")
    b = load_model(model_dirs["llama"], dtype="float32")
    torch.testing.assert_close(a.weights.layers[1].qkv, b.weights.layers[1].qkv)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_selectable(model_dirs, dtype):
    model = load_model(model_dirs["llama"], dtype=dtype)
    assert model.weights.embed.dtype == getattr(torch, dtype)


def test_clear_errors(tmp_path, model_dirs):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(tmp_path)
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_dirs["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(bad)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(bad)
