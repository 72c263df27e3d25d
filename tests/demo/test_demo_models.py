"""The shipped demo pair: size limit, Hugging Face files, loading through transformers and the
executor's loader, and non-degenerate greedy output on a code and a prose prompt."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors import safe_open

from hipfire_serve.demo import demo_block_drafter_dir, demo_draft_dir, demo_model_dir
from hipfire_serve.demo.corpus import chat_text

transformers = pytest.importorskip("transformers")

MAX_PAIR_BYTES = 30_000_000  # both directories together, tokenizer files included
MAX_DEMO_BYTES = 40_000_000  # the target and both drafters
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
PROMPTS = {"code": "class Stack:\n    def push(self, item):", "prose": "KING HENRY.\nNow, lords,"}
NUM_NEW = 24
DIRS = {"target": demo_model_dir(), "draft": demo_draft_dir()}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(demo_model_dir())


@pytest.fixture(scope="module")
def hf_models():
    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for name, d in DIRS.items()
    }


def test_pair_fits_the_size_limit_with_all_files():
    total = 0
    for model_dir in DIRS.values():
        names = {p.name for p in model_dir.iterdir()}
        assert set(REQUIRED_FILES) <= names, model_dir
        total += sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    assert total <= MAX_PAIR_BYTES


def test_the_whole_demo_set_fits_its_budget_and_the_block_drafter_loads():
    from executor.drafters.block_config import is_block_drafter_dir

    block = demo_block_drafter_dir()
    assert is_block_drafter_dir(block)
    dirs = [*DIRS.values(), block]
    total = sum(p.stat().st_size for d in dirs for p in d.iterdir() if p.is_file())
    assert total <= MAX_DEMO_BYTES


def test_weights_are_bf16_and_sizes_match_the_spec():
    num_params = {}
    for name, model_dir in DIRS.items():
        with safe_open(model_dir / "model.safetensors", framework="pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
        assert all(t.dtype == torch.bfloat16 for t in tensors)
        num_params[name] = sum(t.numel() for t in tensors)
    assert 10e6 <= num_params["target"] <= 15e6
    assert 1e6 <= num_params["draft"] <= 3e6


def test_target_and_draft_share_tokenizer_and_stop_ids(tokenizer):
    target, draft = DIRS["target"], DIRS["draft"]
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    for model_dir in DIRS.values():
        config = json.loads((model_dir / "config.json").read_text())
        gen = json.loads((model_dir / "generation_config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["vocab_size"] == len(tokenizer)
        assert config["eos_token_id"] == gen["eos_token_id"] == eos_ids
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_matches_the_training_format(tokenizer):
    messages = [{"role": "user", "content": "Explain 'assert'."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nExplain 'assert'.<|im_end|>\n<|im_start|>assistant\n"
    bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert bare == "<|im_start|>user\nExplain 'assert'.<|im_end|>\n"
    turn = [*messages, {"role": "assistant", "content": "It checks."}]
    rendered = tokenizer.apply_chat_template(turn, tokenize=False)
    assert rendered == chat_text("Explain 'assert'.", "It checks.")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.fixture(scope="module")
def hf_greedy(hf_models, tokenizer):
    """(model name, prompt kind) -> greedy new token ids from transformers' generate."""
    out = {}
    for name, model in hf_models.items():
        for kind, prompt in PROMPTS.items():
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gen = model.generate(
                ids, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
            )
            out[name, kind] = gen[0, ids.shape[1] :].tolist()
    return out


def assert_not_degenerate(token_ids: list[int]) -> None:
    assert len(token_ids) == NUM_NEW
    assert len(set(token_ids)) / len(token_ids) >= 0.25, token_ids
    longest_run = run = 1
    for prev, cur in itertools.pairwise(token_ids):
        run = run + 1 if prev == cur else 1
        longest_run = max(longest_run, run)
    assert longest_run <= 8, token_ids


@pytest.mark.parametrize("model_name", list(DIRS))
@pytest.mark.parametrize("kind", list(PROMPTS))
def test_transformers_greedy_output_is_not_degenerate(hf_greedy, tokenizer, model_name, kind):
    new_ids = hf_greedy[model_name, kind]
    assert_not_degenerate(new_ids)
    assert tokenizer.decode(new_ids).strip()


def _paged_greedy(model, prompt_ids: list[int], num_new: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill then one-row decode steps through the executor's paged forward; returns the
    prefill logits [P, V] and the greedy tokens."""
    from executor.kv_cache import KVCache
    from executor.model import AttnMetadata

    block_size = 16
    num_blocks = (len(prompt_ids) + num_new) // block_size + 1
    kv = KVCache.allocate(
        model.config,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=model.dtype,
        device=torch.device("cpu"),
    )
    table = torch.arange(num_blocks, dtype=torch.int32)[None]  # [1, num_blocks]

    def forward(ids: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids))
        meta = AttnMetadata(
            positions=pos,
            slot_mapping=pos.clone(),  # blocks in order: slot == position
            cu_q_lens=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([start + len(ids)], dtype=torch.int32),
            block_tables=table,
        )
        return model.logits(model.forward(torch.tensor(ids), meta, kv.k, kv.v))  # [n, V]

    prefill_logits = forward(prompt_ids, 0)
    tokens = [int(prefill_logits[-1].argmax())]
    for _ in range(num_new - 1):
        tokens.append(int(forward(tokens[-1:], len(prompt_ids) + len(tokens) - 1)[-1].argmax()))
    return prefill_logits, tokens


@pytest.mark.parametrize("model_name", list(DIRS))
def test_executor_loader_serves_the_pair_like_transformers(
    hf_models, hf_greedy, tokenizer, model_name
):
    loader = pytest.importorskip("executor.loader")
    model = loader.load_model(DIRS[model_name], dtype="float32", device="cpu")
    for kind, prompt in PROMPTS.items():
        prompt_ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            logits, tokens = _paged_greedy(model, prompt_ids, NUM_NEW)
            ref_logits = hf_models[model_name](torch.tensor([prompt_ids])).logits[0]  # [P, V]
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=0)
        assert tokens == hf_greedy[model_name, kind], kind
        assert_not_degenerate(tokens)
