"""GGUF checkpoints: the torch block decoders against `gguf.quants.dequantize`; tiny llama,
qwen2 and qwen3 files (tests/quant/gguf_fixture.py, Q8_0 / Q4_K / Q6_K / BF16 / F32 tensors)
load into the weights, logits and greedy tokens of the safetensors checkpoint holding the same
dequantized weights, with the tokenizer and chat template of their metadata; what is not read
is refused in one line."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from executor.gguf import blocks
from executor.loader import load_model
from executor.model_config import ModelLoadError
from hipfire_serve.tokenizer import Tokenizer
from tests.fixtures.tiny_models import make_tiny_model
from tests.quant.forward import greedy, prompt_logits
from tests.quant.gguf_fixture import encode_q4_k, encode_q6_k, write_dense_copy, write_gguf

ARCHS = ("llama", "qwen2", "qwen3")
PROMPT = [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2]
TEXTS = ["Grüße aus Köln 🚀  x\n\n def f(a):\n    return a", "<|im_start|>user\nhi<|im_end|>"]


def _random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of a `qtype` tensor [rows, cols] whose floats (block scales) are finite."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == blocks.F32:
        return x.view(np.uint8)
    if qtype == blocks.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype == blocks.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    values, size = blocks.BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for at in {blocks.Q8_0: (0,), blocks.Q4_K: (0, 2), blocks.Q6_K: (208,)}[qtype]:
        d = rng.uniform(-0.1, 0.1, size=raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(blocks.BLOCKS), ids=lambda t: blocks.NAMES[t])
def test_block_decoders_match_gguf_reference(qtype):
    raw = _random_blocks(qtype, 6, 512, seed=qtype)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(6, 512)
    out = blocks.dequantize(torch.from_numpy(raw), qtype, (6, 512), torch.float32)
    np.testing.assert_array_equal(out.numpy(), ref.astype(np.float32))


def test_fixture_encoders_round_trip_through_gguf_reference():
    """The fixture's own Q4_K / Q6_K writers produce blocks the independent decoder reads
    back as the input, within each format's rounding."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    for encode, qtype, tol in ((encode_q4_k, "Q4_K", 0.25), (encode_q6_k, "Q6_K", 0.06)):
        back = gguf.quants.dequantize(encode(x), getattr(gguf.GGMLQuantizationType, qtype))
        assert np.abs(back.reshape(x.shape) - x).max() < tol * np.abs(x).max(), qtype


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (HF dir, GGUF file, dense copy of what the file holds); 256 inputs per row, so
    the K-quants apply (qwen3's 64-wide o_proj falls back to Q8_0)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        root = tmp_path_factory.mktemp(arch)
        hf = make_tiny_model(root / "hf", arch, seed=30 + i, hidden_size=256, intermediate_size=512)
        types = {"token_embd": "BF16", "attn_output": "F32"} if arch == "qwen2" else None
        decoded = write_gguf(hf, root / f"{arch}.gguf", arch, types)
        out[arch] = (hf, root / f"{arch}.gguf", write_dense_copy(hf, decoded, root / "dense"))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_model_matches_its_dequantized_safetensors(checkpoints, arch):
    _, path, dense_dir = checkpoints[arch]
    model = load_model(path, dtype="float32")
    dense = load_model(dense_dir, dtype="float32")
    assert dataclasses.replace(model.config, torch_dtype="float32") == dense.config
    for got, want in zip(
        vars(model.weights.layers[1]).values(), vars(dense.weights.layers[1]).values()
    ):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(model.weights.embed, dense.weights.embed, rtol=0, atol=0)
    torch.testing.assert_close(model.weights.lm_head, dense.weights.lm_head, rtol=0, atol=0)
    torch.testing.assert_close(prompt_logits(model, PROMPT), prompt_logits(dense, PROMPT))
    assert greedy(model, PROMPT, 8) == greedy(dense, PROMPT, 8)


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_gguf_tokenizer_and_template_match_the_hf_directory(checkpoints, arch):
    hf_dir, path, _ = checkpoints[arch]
    tok, ref = Tokenizer.from_dir(path), Tokenizer.from_dir(hf_dir)
    assert Tokenizer.from_dir(path.parent).vocab_size == ref.vocab_size  # the directory form
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(ref.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert 0 in tok.eos_token_ids and tok.is_special(ref.token_to_id("<|im_end|>"))


def test_gguf_serves_through_the_offline_api(checkpoints):
    from hipfire_serve import LLM, SamplingParams

    _, path, dense_dir = checkpoints["qwen3"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [
        LLM(str(p), device="cpu", dtype="float32", draft="none").generate(
            ["def add(a, b):"], params
        )
        for p in (path, dense_dir)
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    assert outs[0][0].outputs[0].text == outs[1][0].outputs[0].text


def _minimal_gguf(path, arch="qwen3", tokenizer_model="gpt2", extra_tensor=None):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (
        ("embedding_length", 32),
        ("block_count", 1),
        ("feed_forward_length", 64),
        ("attention.head_count", 2),
    ):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_files_are_refused_in_one_line(tmp_path):
    q5 = np.zeros((4, 176), dtype=np.uint8)  # 4 rows of 256 Q5_K values
    cases = [
        (_minimal_gguf(tmp_path / "g.gguf", arch="gemma"), "GGUF architecture 'gemma'"),
        (
            _minimal_gguf(
                tmp_path / "q.gguf",
                extra_tensor=("blk.0.ffn_up.weight", q5, gguf.GGMLQuantizationType.Q5_K),
            ),
            "holds Q5_K tensors",
        ),
    ]
    for path, words in cases:
        with pytest.raises(ModelLoadError, match=words) as err:
            load_model(path)
        assert "\n" not in str(err.value)
    spm = _minimal_gguf(tmp_path / "s.gguf", tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' \\(SentencePiece"):
        Tokenizer.from_dir(spm)
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        _minimal_gguf(tmp_path / "two" / name)
    with pytest.raises(ModelLoadError, match=r"several \.gguf files"):
        load_model(tmp_path / "two")


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("default", ["Hello", "Ġ12345", "Ġworld", "'", "S"]),  # case-sensitive contractions
        ("qwen2", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'S"]),
        ("llama-bpe", ["Hello", "Ġ", "123", "45", "Ġworld", "'S"]),
    ],
)
def test_pre_tokenizers_split_as_their_model_families(pre, words):
    from executor.gguf.vocab import _bpe_tokenizer

    tok = _bpe_tokenizer(["a"], [1], [], pre)
    assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("Hello 12345 world'S")] == words
