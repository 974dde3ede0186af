"""vLLM's spec_decode counters on the gateway's /metrics, from each LLM worker's speculation counters
(its heartbeat's SpeculationLoad), beside pagemesh's own per-worker series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagemesh.common.messages import ClusterStatus, SpeculationLoad, WorkerStatus
from pagemesh.gateway.metrics import GatewayMetrics
from pagemesh.workers.engine.speculative import SpeculationStats

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _status(load: SpeculationLoad | None) -> ClusterStatus:
    worker = WorkerStatus(
        worker_id="d0", kind="llm", role="decode", alive=True, running=1, waiting=0, requests_finished=0,
        kv=None, model=MODEL, speculation=load,
    )  # fmt: skip
    return ClusterStatus(ready=True, workers=[worker], queued=0, migrations=0)


def test_stats_count_passes_drafts_and_accepted_tokens_per_position():
    stats = SpeculationStats()
    for proposed, accepted in [(4, 4), (4, 1), (3, 0), (2, 2)]:
        stats.record(proposed, accepted)
    assert (stats.passes, stats.proposed, stats.accepted) == (4, 13, 7)
    assert stats.accepted_per_pos == [3, 2, 1, 1]  # position j: passes that kept their j-th draft


def test_vllm_spec_decode_counters_carry_vllms_names_and_labels():
    m = GatewayMetrics(MODEL)
    load = SpeculationLoad(verify_passes=4, draft_tokens=13, accepted_tokens=7, accepted_per_pos=[3, 2, 1, 1])
    m.update_cluster(_status(load))
    got = {}
    for family in text_string_to_metric_families(m.render()):
        for s in family.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    labels = (("engine", "d0"), ("model_name", MODEL))
    assert got[("vllm:spec_decode_num_drafts_total", labels)] == 4
    assert got[("vllm:spec_decode_num_draft_tokens_total", labels)] == 13
    assert got[("vllm:spec_decode_num_accepted_tokens_total", labels)] == 7
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = {dict(k[1])["position"]: v for k, v in got.items() if k[0] == name}
    assert per_pos == {"0": 3, "1": 2, "2": 1, "3": 1}
    assert got[("pagemesh_spec_decode_accepted_tokens_total", (("worker", "d0"),))] == 7
    m.update_cluster(_status(None))  # a worker that does not speculate: no spec_decode series
    samples = [line for line in m.render().splitlines() if "spec_decode" in line and not line.startswith("#")]
    assert samples == []
