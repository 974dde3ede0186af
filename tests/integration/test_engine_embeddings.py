"""Embedding requests in the engine against Hugging Face transformers on the same weights (fp32):
the final-norm hidden state of the last token (or the mean over the prompt), L2-normalised, over
prefill chunks of 32 tokens batched with a generation; no page held afterwards."""

import pytest
import torch

from pagemesh.common.messages import Pooling
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.conftest import hf_argmax_after_each
from pagemesh.workers.engine.pooling import embed

pytestmark = pytest.mark.slow
TEXT = "Paged attention keeps the KV cache in fixed-size pages, so that memory is allocated on demand. "


def hf_embedding(hf_model, ids: list[int], pooling: Pooling) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    pooled = hidden[-1] if pooling is Pooling.LAST else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0)


def assert_close(ours: list[float], reference: torch.Tensor) -> None:
    vector = torch.tensor(ours)
    assert vector.shape == reference.shape
    assert abs(float(vector.norm()) - 1.0) < 1e-5
    assert float(torch.dot(vector, reference)) > 1 - 1e-5  # cosine
    assert float((vector - reference).abs().max()) < 1e-4


def prompts(tokenizer) -> list[list[int]]:
    """1 to ~90 tokens: one token, one chunk, and three chunks of the engine's 32."""
    return [tokenizer.encode(t) for t in ("Hi", "The sky is blue because", TEXT * 4)]


@pytest.mark.parametrize("pooling", [Pooling.LAST, Pooling.MEAN])
def test_embeddings_equal_hf_s_pooled_hidden_states_and_leave_no_page_held(engine_fp32, hf_model, pooling):
    engine = engine_fp32
    batch = prompts(engine.tokenizer)
    assert [len(p) > 64 for p in batch] == [False, False, True] and len(batch[0]) == 1
    # a generation shares the steps: its tokens are HF's greedy ones all the same
    generation = engine.tokenizer.encode("Once upon a time")
    engine.add_request("gen", generation, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for i, ids in enumerate(batch):
        engine.admit_embedding(f"emb-{i}", ids, pooling)
    vectors, tokens = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.embedding is not None:
                assert (
                    out.outputs == [] and out.finished and out.num_prompt_tokens == len(batch[int(out.request_id[4:])])
                )
                vectors[out.request_id] = out.embedding
            else:
                tokens += [t for so in out.outputs for t in so.new_token_ids]
    for i, ids in enumerate(batch):
        assert_close(vectors[f"emb-{i}"], hf_embedding(hf_model, ids, pooling))
    assert tokens == hf_argmax_after_each(hf_model, generation, tokens)
    engine.blocks.check_invariants([])
    assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages  # cached pages are evictable: free


def test_the_prefix_cache_serves_a_last_token_pooling_but_never_a_mean(engine_fp32, hf_model):
    """Pages hold K/V only: a mean needs every position's hidden state, so it runs the whole
    prompt; the last token's needs its own position only, and the cached prefix's K/V."""
    engine = engine_fp32
    ids = engine.tokenizer.encode(TEXT * 3)
    [first] = embed(engine, [ids], Pooling.LAST)
    hits = engine.blocks.prefix_hits
    [again] = embed(engine, [ids], Pooling.LAST)
    assert engine.blocks.prefix_hits > hits and torch.allclose(torch.tensor(again), torch.tensor(first), atol=1e-5)
    hits = engine.blocks.prefix_hits
    [mean] = embed(engine, [ids], Pooling.MEAN)
    assert engine.blocks.prefix_hits == hits
    assert_close(mean, hf_embedding(hf_model, ids, Pooling.MEAN))
    engine.blocks.check_invariants([])
