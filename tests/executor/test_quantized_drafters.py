"""Quantized drafters: FP8 (128x128 block scales), GPTQ (4-bit, W4A16) and GGUF Q8_0 copies of the
demo chain draft model, and FP8 and GPTQ copies of the demo block drafter, written offline by the
target's checkpoint writers (tests/quant). Each loads through the target's loader code, drafts
with speculation token-identical to plain decoding, proposes greedy drafts that mostly agree with
the dense drafter's, and counts its bytes as held; what cannot load is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from executor.drafters.block_model import BlockDraftModel, load_block_drafter
from executor.drafters.draft_model import DraftModelDrafter
from executor.hidden_capture import HiddenCapture
from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import AttnMetadata, Model
from executor.model_config import ModelLoadError
from executor.quant.int4 import Int4Linear
from hipfire_serve import LLM, SamplingParams
from hipfire_serve.demo import demo_block_drafter_dir, demo_draft_dir, demo_model_dir
from tests.executor.test_drafters import make_drafter, propose_one
from tests.quant.gguf_fixture import write_gguf
from tests.quant.quant_fixture import write_dense_copy, write_fp8, write_int4

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["class Stack:\n    def push(self, item):", "KING HENRY.\nNow, lords,", "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
Q8_0 = dict.fromkeys(
    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd"),
    "Q8_0",
)
# Floors of the share of greedy draft positions equal to the dense drafter's; these copies
# measure fp8 0.95, gptq 0.64 (4-bit round-to-nearest, chains diverge after a miss), gguf-q8_0
# 1.0 for the chain draft model, and fp8 0.97, gptq 0.84 for the block drafter.
CHAIN_FLOOR = {"fp8": 0.85, "gptq": 0.5, "gguf-q8_0": 0.95}
BLOCK_FLOOR = {"fp8": 0.9, "gptq": 0.7}
# The dense demo drafters accept about 0.26 (chain) and 0.17 (block) of their drafts of these
# prompts at depth 5; a broken quantized drafter accepts next to none.
MIN_ACCEPTANCE = 0.1


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """The demo draft model as FP8 (block scales), GPTQ g64 and a GGUF Q8_0 file."""
    root = tmp_path_factory.mktemp("quant_drafts")
    src = demo_draft_dir()
    write_fp8(src, root / "fp8", "block")
    write_int4(src, root / "gptq", "gptq", 64)  # the draft's hidden size is 192
    (root / "gguf").mkdir()
    write_gguf(src, root / "gguf" / "draft-q8_0.gguf", "llama", Q8_0)
    return {"dense": src, "fp8": root / "fp8", "gptq": root / "gptq", "gguf-q8_0": root / "gguf"}


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory):
    """The demo block drafter with every linear layer (fc included) in FP8 or GPTQ g128."""
    root = tmp_path_factory.mktemp("quant_blocks")
    src = demo_block_drafter_dir()
    write_fp8(src, root / "fp8", "block", extra_linears=("fc",))
    write_int4(src, root / "gptq", "gptq", 128, extra_linears=("fc",))
    return {"dense": src, "fp8": root / "fp8", "gptq": root / "gptq"}


@pytest.fixture(scope="module")
def target() -> Model:
    return load_model(demo_model_dir(), dtype="float32")


@pytest.fixture(scope="module")
def ar_tokens():
    """Plain decoding's greedy tokens of the demo target: what every drafter must reproduce."""
    llm = LLM("demo", draft="none", spec_mode="ar", device="cpu", dtype="float32")
    return [
        list(o.prompt_token_ids) + o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)
    ]


def _speculate(draft_dir) -> tuple[LLM, list[list[int]], float]:
    llm = LLM(
        "demo", draft=str(draft_dir), spec_mode="spec", spec_depth=5, device="cpu", dtype="float32"
    )
    outs = llm.generate(PROMPTS, GREEDY)
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    assert drafted > 0
    tokens = [list(o.prompt_token_ids) + o.outputs[0].token_ids for o in outs]
    return llm, tokens, accepted / drafted


@pytest.mark.parametrize("fmt", ["fp8", "gptq", "gguf-q8_0"])
def test_quantized_draft_model_drafts_token_identical_to_ar(draft_dirs, ar_tokens, fmt):
    llm, tokens, acceptance = _speculate(draft_dirs[fmt])
    assert tokens == ar_tokens
    assert acceptance > MIN_ACCEPTANCE, acceptance
    model = llm.engine.drafter.model
    assert isinstance(llm.engine.drafter, DraftModelDrafter)
    dense = load_model(draft_dirs["dense"], dtype="float32")
    if fmt == "gptq":  # packed on the device and counted so (on a CPU FP8 and GGUF dequantize)
        assert isinstance(model.weights.layers[0].qkv, Int4Linear)
        embed = dense.weights.embed.nbytes  # dense in both (tied: the lm_head too)
        assert model.weight_bytes - embed < 0.25 * (dense.weight_bytes - embed)
    else:
        assert model.weight_bytes == dense.weight_bytes
    assert model.num_params == dense.num_params


@pytest.mark.parametrize("fmt", ["fp8", "gptq", "gguf-q8_0"])
def test_quantized_draft_model_greedy_chains_agree_with_the_dense_draft(draft_dirs, ar_tokens, fmt):
    dense = make_drafter(load_model(draft_dirs["dense"], dtype="float32"), {0: list(range(48))})
    quant = make_drafter(load_model(draft_dirs[fmt], dtype="float32"), {0: list(range(48))})
    same = total = 0
    for tokens in ar_tokens:
        for end in range(8, len(tokens), 3):
            context = tokens[:end]
            dense.setup(0, context)
            quant.setup(0, context)
            want = propose_one(dense, 0, context, 4).tokens[0]
            got = propose_one(quant, 0, context, 4).tokens[0]
            same += sum(a == b for a, b in zip(got, want))
            total += len(want)
    assert same / total >= CHAIN_FLOOR[fmt], (fmt, same / total)


@pytest.mark.parametrize("fmt", ["fp8", "gptq"])
def test_quantized_block_drafter_drafts_token_identical_to_ar(block_dirs, ar_tokens, fmt):
    llm, tokens, acceptance = _speculate(block_dirs[fmt])
    assert tokens == ar_tokens
    assert acceptance > MIN_ACCEPTANCE, acceptance
    model = llm.engine.drafter.model
    assert isinstance(model, BlockDraftModel)
    if fmt == "gptq":  # fc, the layers and the fused context k/v stay packed
        assert isinstance(model.weights.fc, Int4Linear)
        assert isinstance(model.context_kv, Int4Linear)
        target = llm.engine.target
        dense = load_block_drafter(block_dirs["dense"], target)
        assert model.weight_bytes < 0.3 * dense.weight_bytes


def _target_states(target: Model, tokens: list[int], layer_ids) -> torch.Tensor:
    """The target's hidden states after `layer_ids` for every row of one prompt forward."""
    n = len(tokens)
    kv = KVCache.allocate(
        target.config, num_blocks=n, block_size=1, dtype=target.dtype, device=target.device
    )
    meta = AttnMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(n, dtype=torch.int32)[None, :],
    )
    capture = HiddenCapture.allocate(
        layer_ids, n, target.config.hidden_size, dtype=target.dtype, device=target.device
    )
    target.forward(torch.tensor(tokens), meta, kv.k, kv.v, capture=capture)
    return capture.rows(n).clone()


@pytest.mark.parametrize("fmt", ["fp8", "gptq"])
def test_quantized_block_drafter_blocks_agree_with_the_dense_drafter(
    block_dirs, target, ar_tokens, fmt
):
    dense = load_block_drafter(block_dirs["dense"], target)
    quant = load_block_drafter(block_dirs[fmt], target)
    same = total = 0
    for tokens in ar_tokens:
        states = _target_states(target, tokens, dense.config.target_layer_ids)
        for end in range(8, len(tokens), 4):
            positions = torch.arange(end - 1, end - 1 + 8)  # [last token, 7 masks]
            drafts = [
                m.draft_block(
                    m.project_context(states[: end - 1]),
                    torch.arange(end - 1),
                    tokens[end - 1],
                    positions,
                ).argmax(-1)
                for m in (dense, quant)
            ]
            same += int((drafts[0] == drafts[1]).sum())
            total += drafts[0].numel()
    assert same / total >= BLOCK_FLOOR[fmt], (fmt, same / total)


def test_act_order_gptq_block_drafter_computes_the_weights_it_stands_for(
    target, ar_tokens, tmp_path
):
    """Act-order gives each layer's k/v their own input order, so the context k/v of all
    layers cannot share one packed weight: they become one dense GEMM, the rest stays packed,
    and the drafter computes what the dequantized checkpoint computes."""
    src = demo_block_drafter_dir()
    dense_sd = write_int4(
        src, tmp_path / "gptq", "gptq", 128, act_order=True, extra_linears=("fc",)
    )
    quant = load_block_drafter(tmp_path / "gptq", target)
    dense = load_block_drafter(write_dense_copy(src, dense_sd, tmp_path / "dense"), target)
    assert isinstance(quant.weights.layers[0].qkv, Int4Linear)
    assert isinstance(quant.context_kv, torch.Tensor)
    tokens = ar_tokens[0]
    states = _target_states(target, tokens, quant.config.target_layer_ids)
    positions = torch.arange(len(tokens) - 1, len(tokens) + 7)
    logits = [
        m.draft_block(
            m.project_context(states[:-1]), torch.arange(len(tokens) - 1), tokens[-1], positions
        )
        for m in (quant, dense)
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-3, rtol=1e-3)


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_a_gguf_block_drafter_is_refused_naming_its_format(block_dirs, target, tmp_path):
    """GGUF names no block-drafter tensors: a DFlash config beside a .gguf is refused."""
    drafter = tmp_path / "block-gguf"
    drafter.mkdir()
    shutil.copy(block_dirs["dense"] / "config.json", drafter / "config.json")
    write_gguf(demo_draft_dir(), drafter / "block-q8_0.gguf", "llama", Q8_0)  # Q8_0 blocks
    with pytest.raises(ModelLoadError) as excinfo:
        load_block_drafter(drafter, target)
    message = _one_line(excinfo)
    assert "quant_method 'gguf Q8_0'" in message and "block drafter" in message


@pytest.mark.parametrize("kind", ["chain", "block"])
def test_an_unsupported_quant_method_is_refused_in_one_line(
    draft_dirs, block_dirs, target, tmp_path, kind
):
    src = draft_dirs["gptq"] if kind == "chain" else block_dirs["gptq"]
    copy = shutil.copytree(src, tmp_path / kind)
    _edit_config(copy, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ModelLoadError) as excinfo:
        if kind == "chain":
            LLM("demo", draft=str(copy), device="cpu")
        else:
            load_block_drafter(copy, target)
    assert "quant_method 'bitsandbytes 4-bit'" in _one_line(excinfo)


def test_fp8_block_drafter_weights_without_a_quantization_config_are_refused(
    block_dirs, target, tmp_path
):
    copy = shutil.copytree(block_dirs["fp8"], tmp_path / "no-config")
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        load_block_drafter(copy, target)
    assert "float8" in _one_line(excinfo) and "'none'" in str(excinfo.value)
