"""An exact resume through the engine's handoff API (services/scheduler/migration.py): the
prefill engine keeps a handed-off request's pages after the acknowledgement, sends the same bits
again for a migrated request, and a second decode engine decodes the tokens streamed before the
loss again, one step each as given (`replay`), reporting none of them. What it then generates,
and the logprob of each token, is what the lost decode engine would have given: greedy, and
seeded sampling whose draws go on where they were. Kept pages are freed when the request ends,
and the oldest go first past the engine's cap."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.llm_tiny import tiny_engine, tiny_llama

PAGE = 4
TOKENS = 24  # generated in all
LOST_AT = 9  # tokens streamed (first one included) when the decode engine is lost
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
PROMPT = [(13 * i) % 250 + 1 for i in range(14)]  # 3 full pages and a partial one


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(seed=9)


def make_engine(model, num_pages=64, batch_invariant=False):
    return tiny_engine(
        model, page_size=PAGE, num_pages=num_pages, enable_prefix_caching=True, batch_invariant=batch_invariant
    )


def prefill(p_engine, rid, prompt, params):
    p_engine.add_request(rid, prompt, params, prefill_only=True)
    while p_engine.take_prefilled(rid) is None:
        p_engine.step()
    return p_engine.export_prefilled(rid)


def import_export(d_engine, rid, prompt, params, export, resumed=()):
    [rank] = export.ranks
    first = export.first_token_ids
    d_engine.import_pages(rid, prompt, params, first, [list(rank.pages.unbind(0))], [[]], (), resumed=resumed)


def decode(d_engine, until: int | None = None, choice: int = 0) -> tuple[list[int], list[float]]:
    """Step until the engine is done (or `until` tokens of `choice` came): the tokens and
    logprobs reported of `choice`."""
    tokens: list[int] = []
    logprobs: list[float] = []
    while d_engine.has_unfinished() and (until is None or len(tokens) < until):
        for out in d_engine.step():
            for so in out.outputs:
                if so.index == choice:
                    tokens += so.new_token_ids
                    logprobs += [lp.logprob for lp in so.logprobs]
    return tokens, logprobs


def all_free(engine) -> None:
    engine.blocks.check_invariants(live_tables=[])
    assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_request_goes_on_with_the_lost_engines_tokens_and_logprobs(tiny_model, params):
    # the run without a fault
    p_engine = make_engine(tiny_model)
    export = prefill(p_engine, "ref", PROMPT, params)
    p_engine.release_prefilled("ref")
    reference = make_engine(tiny_model)
    import_export(reference, "ref", PROMPT, params, export)
    ref_tokens, ref_logprobs = decode(reference)
    ref_tokens = export.first_token_ids + ref_tokens
    assert len(ref_tokens) == TOKENS

    # the same request, its decode engine lost after LOST_AT tokens
    p_engine = make_engine(tiny_model)
    first = prefill(p_engine, "r", PROMPT, params)
    lost = make_engine(tiny_model)
    import_export(lost, "r", PROMPT, params, first)
    streamed = first.first_token_ids + decode(lost, until=LOST_AT - 1)[0]
    assert streamed == ref_tokens[:LOST_AT]
    p_engine.keep_prefilled("r")  # acknowledged: kept
    kept = p_engine.blocks.num_usable_pages - p_engine.blocks.num_free_pages
    assert kept == -(-len(PROMPT) // PAGE)

    # the resume: the same pages again, the streamed tokens decoded again as given
    assert p_engine.resend_prefilled("r", PROMPT)
    again = p_engine.export_prefilled("r")
    assert torch.equal(again.ranks[0].pages, first.ranks[0].pages)
    new = make_engine(tiny_model)
    import_export(new, "r", PROMPT, params, again, resumed=[(0, streamed)])
    tokens, logprobs = decode(new)
    assert streamed + tokens == ref_tokens  # nothing repeated or lost, the same tokens
    assert logprobs == ref_logprobs[LOST_AT - 1 :]  # and the same numbers, bit for bit
    p_engine.keep_prefilled("r")
    p_engine.release_prefilled("r")  # the request ended: the scheduler's abort frees the kept pages
    all_free(p_engine)
    all_free(new)


def test_kept_pages_are_capped_oldest_first_and_a_resend_checks_the_prompt(tiny_model):
    p_engine = make_engine(tiny_model, num_pages=32)
    pages = -(-len(PROMPT) // PAGE)
    p_engine.handoff.max_kept_pages = 2 * pages  # room for two requests' pages
    for rid in ("a", "b", "c"):
        prefill(p_engine, rid, PROMPT, GREEDY)
        p_engine.keep_prefilled(rid)
    assert list(p_engine.handoff.kept) == ["b", "c"]  # "a", the oldest, was freed
    assert p_engine.blocks.num_usable_pages - p_engine.blocks.num_free_pages <= 2 * pages
    assert not p_engine.resend_prefilled("a", PROMPT)  # none kept
    assert not p_engine.resend_prefilled("b", PROMPT[:-1])  # another prompt: freed, not sent
    assert p_engine.resend_prefilled("c", PROMPT)
    p_engine.release_prefilled("c")
    all_free(p_engine)


def test_each_choice_of_a_resumed_request_goes_on_as_it_would_have(tiny_model):
    """n = 2, seeded: choice 1 ended before the loss (it stays done, nothing of it comes again),
    choice 0 is resumed with its tokens and goes on with the fault-free tokens and logprobs. The
    first run decoded two rows a step, the resume one: this dense fp32 model's linears (MKL)
    give a row other bits in a step of another size, so the decode engines run batch-invariant
    here, as the default GGUF model's quantized linears are without the flag."""
    params = SamplingParams(
        temperature=0.9, seed=5, n=2, max_tokens=TOKENS, ignore_eos=True, logprobs=1, stop_token_ids=()
    )
    p_engine = make_engine(tiny_model)
    export = prefill(p_engine, "n2", PROMPT, params)
    reference = make_engine(tiny_model, batch_invariant=True)
    import_export(reference, "n2", PROMPT, params, export)
    ref0, ref_lp0 = decode(reference, choice=0)
    ref0 = [export.first_token_ids[0]] + ref0
    new = make_engine(tiny_model, batch_invariant=True)
    assert p_engine.resend_prefilled("n2", PROMPT) is False  # not kept: still held, never acknowledged
    import_export(new, "n2", PROMPT, params, p_engine.export_prefilled("n2"), resumed=[(0, ref0[:LOST_AT])])
    assert [s.index for s in new.requests["n2"].seqs] == [0]
    tokens, logprobs = decode(new, choice=0)
    assert ref0[:LOST_AT] + tokens == ref0 and logprobs == ref_lp0[LOST_AT - 1 :]
    all_free(new)
    p_engine.release_prefilled("n2")
    all_free(p_engine)
    with pytest.raises(ValueError, match="without tokens"):
        import_export(new, "n3", PROMPT, params, export, resumed=[(0, [])])
    all_free(new)


def test_every_kept_request_is_freed_at_once_for_a_scheduler_that_forgot_them(tiny_model):
    p_engine = make_engine(tiny_model)
    for rid in ("a", "b"):
        prefill(p_engine, rid, PROMPT, GREEDY)
        p_engine.keep_prefilled(rid)
    assert p_engine.release_kept() == 2
    all_free(p_engine)
    assert not p_engine.resend_prefilled("a", PROMPT)


def test_pages_kept_under_one_id_are_sent_again_under_the_id_the_request_moved_to(tiny_model):
    p_engine = make_engine(tiny_model)
    first = prefill(p_engine, "old", PROMPT, GREEDY)
    p_engine.keep_prefilled("old")
    assert p_engine.resend_prefilled("new", PROMPT, kept_id="old")
    again = p_engine.export_prefilled("new")
    assert again.request_id == "new" and torch.equal(again.ranks[0].pages, first.ranks[0].pages)
    assert not p_engine.resend_prefilled("old", PROMPT)  # nothing is kept under the old id any more
    p_engine.release_prefilled("new")
    all_free(p_engine)
