"""End-to-end greedy generation through the offline API (scheduler + round executor) against
transformers' `generate`, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from hipfire_serve import LLM, SamplingParams
from tests.fixtures.tiny_models import ARCHS, make_tiny_model

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {
        a: make_tiny_model(tmp_path_factory.mktemp(a), a, seed=10 + i) for i, a in enumerate(ARCHS)
    }


def _assert_idle(llm):
    sched = llm.engine.scheduler
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.kv.num_free == sched.kv.num_total
    sched.kv.check()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_64_tokens_match_transformers_generate(model_dirs, arch):
    llm = LLM(
        str(model_dirs[arch]), device="cpu", dtype="float32", draft="none", max_prefill_tokens=32
    )  # prompts of 45 tokens prefill in two chunks
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dirs[arch], dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, llm.engine.target.config.vocab_size, (45,), generator=g).tolist()
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    ref = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=64,
        min_new_tokens=64,
        do_sample=False,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    _assert_idle(llm)


def test_batch_gives_each_request_its_solo_tokens(model_dirs):
    llm = LLM(
        str(model_dirs["qwen3"]),
        device="cpu",
        dtype="float32",
        draft="none",
        max_concurrency=3,
        max_prefill_tokens=48,
    )
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (3, 17, 40, 61, 9)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 12, 25, 7, 33)
    ]
    batched = llm.generate(prompts, params)
    for prompt, p, got in zip(prompts, params, batched):
        solo = llm.generate([prompt], p)[0]
        assert got.outputs[0].token_ids == solo.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == p.max_tokens
    _assert_idle(llm)


def test_text_prompt_and_eos_stop(model_dirs):
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", draft="none")
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=20, temperature=0.0))[0]
    c = out.outputs[0]
    assert out.prompt == "def add(a, b):"
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    # a random model emits invalid UTF-8; replacement characters may group differently at the
    # streaming windows' edges, the valid text may not
    assert c.text.replace("\ufffd", "") == llm.tokenizer.decode(c.token_ids).replace("\ufffd", "")
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert c.token_ids[-1] in llm.tokenizer.eos_token_ids
    _assert_idle(llm)


def test_bad_input_is_a_clear_error_and_leaves_engine_usable(model_dirs):
    llm = LLM(
        str(model_dirs["llama"]), device="cpu", dtype="float32", draft="none", max_model_len=128
    )
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.generate([list(range(1, 100))], SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("hi", SamplingParams(top_p=0.0))
    with pytest.raises(TypeError, match="unknown option"):
        LLM(str(model_dirs["llama"]), device="cpu", no_such_flag=1)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    _assert_idle(llm)
