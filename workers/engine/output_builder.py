"""What a step reports of each request it touched (`RequestOutput`): new tokens per choice as
they come (streaming), or, for best_of > n and beam search, the n best choices once it ends.
Each request remembers what it has reported (`EngineRequest.finished_sent`, ...)."""

from __future__ import annotations

from pagemesh.workers.engine.outputs import RequestOutput, SeqOutput
from pagemesh.workers.engine.sequence import EngineRequest


def build_outputs(touched: list[EngineRequest]) -> list[RequestOutput]:
    """One output per request, in order; `finished` once all its choices are done."""
    outputs = []
    for req in touched:
        done = req.done
        first = req.seqs[0]
        if first.pooling is not None:  # an embedding request: its vector, no choices
            seq_outputs = []
        elif req.params.streams:
            seq_outputs = stream_outputs(req)
        else:  # best_of > n or beam search: the n choices are known only at the end
            for seq in req.seqs:
                seq.take_new_tokens()
            seq_outputs = final_choices(req) if done else []
        queue_time = None
        if not req.reported_queue_time and first.first_scheduled is not None:
            queue_time, req.reported_queue_time = first.first_scheduled - first.arrival_time, True
        prompt_logprobs = None
        if (
            req.params.prompt_logprobs is not None
            and not req.sent_prompt_logprobs
            and seq_outputs
            and not first.needs_prompt_logprobs
        ):
            prompt_logprobs, req.sent_prompt_logprobs = first.prompt_logprobs, True
        outputs.append(
            RequestOutput(
                req.request_id,
                seq_outputs,
                done,
                req.num_prompt_tokens,
                first.num_prefix_hit_tokens,
                queue_time,
                prompt_logprobs,
                first.embedding,
            )
        )
    return outputs


def stream_outputs(req: EngineRequest) -> list[SeqOutput]:
    """Each choice's tokens since the last step, and its finish once (a prefill-only request's
    choices are "prefilled", which is reported as not finished: decoding continues elsewhere)."""
    seq_outputs = []
    for seq in req.seqs:
        ids, lps = seq.take_new_tokens()
        if ids or (seq.finished and seq.index not in req.finished_sent):
            reason = None if seq.finish_reason == "prefilled" else seq.finish_reason
            seq_outputs.append(SeqOutput(seq.index, ids, lps, reason))
            if seq.finished:
                req.finished_sent.add(seq.index)
    return seq_outputs


def final_choices(req: EngineRequest) -> list[SeqOutput]:
    """The n best of a finished request: beam hypotheses by score, else sequences by cumulative
    logprob."""
    n = req.params.n
    if req.beam is not None:
        return [SeqOutput(i, h.output_ids, [], h.finish_reason) for i, h in enumerate(req.beam.best(n))]
    best = sorted(req.seqs, key=lambda s: -s.cumulative_logprob)[:n]
    return [SeqOutput(i, s.output_token_ids, [], s.finish_reason) for i, s in enumerate(best)]
