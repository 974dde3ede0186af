"""Turn each row of logits into a token under that row's own sampling parameters.

Order: raw log-probabilities (reported to clients) → penalties → logit_bias → the grammar's bitmask
(structured outputs) → min_tokens masking → greedy or temperature → top-k / top-p / min-p → an exponential race (argmax
of p / E, E ~ Exp(1)), which samples from p and lets each seeded row draw from its own generator,
so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagemesh.common.messages import TokenLogprob
from pagemesh.common.sampling import SamplingParams

if TYPE_CHECKING:
    from pagemesh.workers.engine.backend import Backend


@dataclass
class SampleRow:
    """Everything the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    banned_ids: tuple[int, ...] = ()  # EOS/stop ids while min_tokens is not reached
    allowed: torch.Tensor | None = None  # int32 [ceil(V / 32)]: the bitmask of the only tokens it may take
    want_logprob: bool = False  # report the sampled token's logprob even without `logprobs`


def sample(
    logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator, backend: Backend | None = None
) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [R, V] fp32 (modified in place). Returns (token, logprobs or None) per row.

    Everything runs on the logits' device; only tokens and the logprobs asked for come to the
    host. A batch of plain greedy rows (`argmax_only`) is one argmax. `default_generator` draws
    for unseeded rows and should live on that device; a seeded row's own generator may be a host
    generator (its draws are then made on the host and copied, so they do not depend on the
    device either). `backend` picks greedy rows' argmax (`Backend.first_max`; without one, torch's)."""
    if logits.device.type != "cpu" and all(argmax_only(r) for r in rows):
        return [(tok, None) for tok in logits.argmax(dim=-1).tolist()]
    raw_logprobs = None
    if any(r.params.logprobs is not None or r.want_logprob for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    _apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            add_logit_bias(logits[i], r.params.logit_bias)
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if masked:
        apply_token_bitmask(logits, masked, torch.stack([rows[i].allowed for i in masked]))
    for i, r in enumerate(rows):
        if r.banned_ids:
            logits[i, list(r.banned_ids)] = float("-inf")
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    first_max = backend.first_max if backend is not None else _torch_first_max
    if len(greedy) == len(rows):
        tokens = first_max(logits)
    elif greedy:
        tokens[greedy] = first_max(logits[greedy])
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random:
        tokens[random] = _sample_random(logits[random], [rows[i] for i in random], default_generator)
    token_list = tokens.tolist()
    logprobs = _report_logprobs(raw_logprobs, tokens, token_list, rows) if raw_logprobs is not None else {}
    return [(tok, logprobs.get(i)) for i, tok in enumerate(token_list)]


def _report_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int], rows: list[SampleRow]
) -> dict[int, TokenLogprob]:
    """The sampled token's logprob and the top-k of each row that asks, read to the host in a
    few batched copies (one for the sampled tokens, two per distinct k), not a few per row."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None or r.want_logprob]
    index = torch.tensor(want, device=raw.device)
    chosen = raw.index_select(0, index).gather(1, tokens.index_select(0, index).unsqueeze(1))
    out = {
        i: TokenLogprob(token_id=token_list[i], logprob=lp, top_ids=[], top_logprobs=[])
        for i, lp in zip(want, chosen.squeeze(1).tolist())
    }
    by_k: dict[int, list[int]] = {}
    for i in want:
        if rows[i].params.logprobs:
            by_k.setdefault(rows[i].params.logprobs, []).append(i)
    for k, members in by_k.items():
        top = raw.index_select(0, torch.tensor(members, device=raw.device)).topk(k)
        for i, ids, values in zip(members, top.indices.tolist(), top.values.tolist()):
            out[i].top_ids.extend(ids)
            out[i].top_logprobs.extend(values)
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """logits: [P, V], row j the model's prediction for prompt token `targets[j]`. Each target's
    logprob and the top-k, as for sampled tokens (raw log-softmax, no sampling parameters)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, torch.tensor(targets, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
    out = [TokenLogprob(token_id=t, logprob=lp, top_ids=[], top_logprobs=[]) for t, lp in zip(targets, chosen)]
    if k:
        top = raw.topk(k)
        for entry, ids, values in zip(out, top.indices.tolist(), top.values.tolist()):
            entry.top_ids.extend(ids)
            entry.top_logprobs.extend(values)
    return out


def argmax_only(row: SampleRow) -> bool:
    """The row's token is its logits' first maximum and nothing else is reported: greedy, no
    penalties, no logit bias, no banned ids, no logprobs."""
    p = row.params
    return (
        p.greedy
        and not row.banned_ids
        and row.allowed is None
        and p.logprobs is None
        and not row.want_logprob
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and not p.logit_bias
    )


def add_logit_bias(logits: torch.Tensor, logit_bias: tuple[tuple[int, float], ...]) -> None:
    """logits[..., id] += bias for each pair (in place; the ids are distinct)."""
    ids = torch.tensor([i for i, _ in logit_bias], dtype=torch.int64, device=logits.device)
    logits[..., ids] += torch.tensor([b for _, b in logit_bias], dtype=logits.dtype, device=logits.device)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], packed: torch.Tensor) -> None:
    """Set to -inf the logits of the tokens each of `rows` may not take (in place). logits: [R, V];
    packed: int32 [len(rows), ceil(V / 32)], bit i of word w allowing token 32w + i (llguidance's
    layout; workers/engine/grammar_masks.py fills it). Each byte of the mask picks its 8 tokens'
    0 / -inf from a 256-entry table, added to the logits: a gather and an add (a bool mask and
    `masked_fill_` were ~10x slower on a CPU)."""
    device = logits.device
    refused = ((torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1) == 0
    table = torch.zeros(256, 8, dtype=logits.dtype, device=device).masked_fill_(refused, float("-inf"))
    words = packed.to(device, non_blocking=True).contiguous()
    bytes_ = words.view(torch.uint8).flatten().long()  # little-endian: byte k of a word holds bits 8k..8k+7
    add = table.index_select(0, bytes_).view(len(rows), -1)[:, : logits.shape[1]]
    if len(rows) == logits.shape[0]:
        logits += add
    else:
        logits.index_add_(0, torch.tensor(rows, device=device), add)


def _torch_first_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.int64, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            ids = torch.tensor(r.output_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_random(logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device).unsqueeze(1)
    logits = logits / temps
    top_ks = [r.params.top_k for r in rows]
    top_ps = [r.params.top_p for r in rows]
    vocab = logits.shape[1]
    if any(k != -1 and k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k = torch.tensor([k if k != -1 else vocab for k in top_ks], device=device).unsqueeze(1)
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before > torch.tensor(top_ps, dtype=probs.dtype, device=device).unsqueeze(1)
        drop[:, 0] = False  # always keep the most likely token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_ps = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        gen = r.generator or default_generator
        if gen.device.type == device.type:
            noise[i].exponential_(generator=gen)
        else:  # a host generator for a row on the GPU
            noise[i].copy_(torch.empty(vocab, dtype=noise.dtype).exponential_(generator=gen))
    return (probs / noise).max(dim=-1).indices
