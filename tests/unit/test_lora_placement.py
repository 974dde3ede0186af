"""Where a LoRA request goes (services/scheduler/placement.py): only to workers that know its
adapter, by preference one that holds it in a slot (LoRA affinity), never by a cached prefix of
the base model's keys (an adapter's pages are keyed apart)."""

from __future__ import annotations

from pagemesh.common.messages import LoRALoad
from pagemesh.services.scheduler.placement import Placer
from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.tests.unit.test_prefix_placement import PROMPT, worker


def with_adapters(info, known: list[str], in_slots: list[str]):
    info.lora = LoRALoad(known=known, in_slots=in_slots, running=[], waiting=[], max_loras=2)
    info.lora_known = set(known)
    return info


def test_a_worker_holding_the_adapter_wins_over_a_less_loaded_one_and_one_that_lacks_it_never_gets_it():
    lacks = with_adapters(worker("m0", "mixed"), [], [])
    holds = with_adapters(worker("m1", "mixed", load=2), ["sql"], ["sql"])
    knows = with_adapters(worker("m2", "mixed", load=1), ["sql"], [])
    placed = Placer().place([], [], [lacks, holds, knows], PromptPages(PROMPT, lora="sql"))
    assert placed.worker.worker_id == "m1"
    placed = Placer().place([], [], [lacks, knows], PromptPages(PROMPT, lora="sql"))
    assert placed.worker.worker_id == "m2"
    assert Placer().place([], [], [lacks], PromptPages(PROMPT, lora="sql")) is None  # it waits
    assert Placer().place([], [], [lacks], PromptPages(PROMPT)).worker.worker_id == "m0"  # the base model


def test_a_base_models_cached_prefix_neither_draws_an_adapters_request_nor_skips_its_pages():
    p = with_adapters(worker("p0", "prefill"), ["sql"], [])
    cached = with_adapters(worker("d0", "decode", held=4), ["sql"], [])
    fresh = with_adapters(worker("d1", "decode"), ["sql"], [])
    base = Placer().place([p], [cached, fresh], [], PromptPages(PROMPT))
    assert base.worker.worker_id == "d0" and base.skip_pages == 4
    adapted = Placer().place([p], [cached, fresh], [], PromptPages(PROMPT, lora="sql"))
    assert adapted.skip_pages == 0  # its prompt's pages all travel: the held ones are the base model's
