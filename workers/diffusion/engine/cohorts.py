"""One sampler step for many requests at once: the requests of a step batch whose samplers are in
the same state (same deterministic sampler, same step count, same step, same scheduler config)
take one scheduler call over their stacked rows instead of one call each.

    [(sampler, model output, latents)] ──group by (name, steps, index, config)──▶ cohorts
      a cohort of one           ─▶ its own sampler.step
      a cohort of k requests    ─▶ the first one's scheduler holds the k requests' per-row state,
                                   stacked (solver history: model_outputs, last_sample, ...)
                                 ─▶ one scheduler.step over the stacked rows
                                 ─▶ each request gets its rows of the result and of the new
                                    per-row state, and a copy of the shared state (step index,
                                    order counters, timestep lists)

Why it is exact: the schedulers here (DDIM, DPM-Solver++, UniPC, Euler without churn) update
each latent element from the same element of the model output and of the history, with
coefficients that depend only on the step, not on the rows; so row r of the stacked call is the
numbers of request r's own call (tests/unit/test_sampler_cohorts.py checks it bit for bit).
Samplers that draw noise at each step (DDPM, LCM) use each request's own generators and always
step alone, as does a sampler that keeps a learned variance.

A scheduler's per-row state is found by shape: a tensor shaped like the request's latents (or a
list of them, None allowed). Everything else a step changes is the same for every member (they
were in the same state), and each member gets its own copy of it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from pagemesh.workers.diffusion.engine.samplers import RequestSampler

COHORT_SAMPLERS = frozenset({"ddim", "dpmsolver++", "unipc", "euler"})  # deterministic steps
_SHARED_TYPES = (int, float, bool, str, type(None), list, tuple)


def cohort_key(sampler: RequestSampler) -> tuple | None:
    """Samplers with the same key step together; None: this one steps alone. (One engine serves
    one pipeline: its requests' samplers are built from the same scheduler config.)"""
    if sampler.name not in COHORT_SAMPLERS:
        return None
    return sampler.name, len(sampler.timesteps), sampler.index


def step_all(members: Sequence[tuple[RequestSampler, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each member's latents after one step of its sampler, in order. `members`: (sampler, its
    model output, its latents); a model output may carry extra channels (dropped, as alone)."""
    out: list[torch.Tensor | None] = [None] * len(members)
    cohorts: dict[tuple, list[int]] = {}
    for i, (sampler, _, _) in enumerate(members):
        key = cohort_key(sampler)
        if key is None:
            out[i] = sampler.step(members[i][1], members[i][2])
        else:
            cohorts.setdefault(key, []).append(i)
    for indices in cohorts.values():
        if len(indices) == 1:
            i = indices[0]
            out[i] = members[i][0].step(members[i][1], members[i][2])
            continue
        for i, latents in zip(indices, _step_cohort([members[i] for i in indices])):
            out[i] = latents
    return out


def _per_row(value, like: torch.Tensor) -> bool:
    """A tensor shaped like one request's latents, or a list/tuple of such tensors (None allowed)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == like.dim() and value.shape == like.shape
    if isinstance(value, (list, tuple)) and value:
        return all(v is None or _per_row(v, like) for v in value) and any(v is not None for v in value)
    return False


def _stack(values: list):
    """The members' values of one per-row attribute, stacked along the rows."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    return type(first)(None if parts[0] is None else torch.cat(parts) for parts in zip(*values))


def _split(value, sizes: list[int]) -> list:
    if isinstance(value, torch.Tensor):
        return list(value.split(sizes))
    pieces = [[] for _ in sizes]
    for item in value:
        for j, piece in enumerate([None] * len(sizes) if item is None else item.split(sizes)):
            pieces[j].append(piece)
    return [type(value)(p) for p in pieces]


def _step_cohort(members: list[tuple[RequestSampler, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    samplers = [m[0] for m in members]
    lead, like = samplers[0].scheduler, members[0][2]
    names = [k for k, v in vars(lead).items() if _per_row(v, like)]
    if not all(_same_structure(getattr(s.scheduler, k), getattr(lead, k)) for s in samplers[1:] for k in names):
        # a member whose history differs in structure (cannot happen in one state): each alone
        return [s.step(o, x) for s, o, x in members]
    sizes = [m[2].shape[0] for m in members]
    for name in names:
        setattr(lead, name, _stack([getattr(s.scheduler, name) for s in samplers]))
    channels = like.shape[1]
    outputs = torch.cat([o[:, :channels] for _, o, _ in members])
    stepped = samplers[0].step(outputs, torch.cat([x for _, _, x in members]))
    per_row = {k: _split(v, sizes) for k, v in vars(lead).items() if _per_row(v, stepped)}
    # what else a step changes: counters, step index, order, lists of timesteps (the schedule's
    # tensors and the config are the same in every member and are not touched)
    shared = {k: v for k, v in vars(lead).items() if k not in per_row and isinstance(v, _SHARED_TYPES)}
    for j, sampler in enumerate(samplers):
        if j:
            for name, value in shared.items():
                if isinstance(value, list):  # a list the scheduler mutates in place: its own copy
                    value = copy.copy(value)
                setattr(sampler.scheduler, name, value)
            sampler.index = samplers[0].index
        for name, pieces in per_row.items():
            setattr(sampler.scheduler, name, pieces[j])
    return list(stepped.split(sizes))


def _same_structure(value, lead_value) -> bool:
    if isinstance(lead_value, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape[1:] == lead_value.shape[1:]
    return (
        isinstance(value, type(lead_value))
        and len(value) == len(lead_value)
        and all((a is None) == (b is None) for a, b in zip(value, lead_value))
    )
