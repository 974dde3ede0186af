"""Per-worker and cluster series, copied from the scheduler's ClusterStatus at each scrape.

Each per-worker value is written twice: under vLLM's name with its labels (`model_name` = the
model the worker serves, `engine` = the worker id: one vLLM engine per worker) so a vLLM
dashboard finds it, and under pagemesh's name with `worker` (what our docs, tests and benches
read). With no status (the scheduler did not answer) the collector yields nothing: no stale
series.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagemesh.common.messages import ClusterStatus


class ClusterCollector(Collector):
    """Set `status` before a render; `collect()` turns it into metric families."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.status: ClusterStatus | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        workers = status.workers
        v = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=v
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=v
        )
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=v)
        p_running = GaugeMetricFamily(
            "pagemesh_num_requests_running", "Requests running on each worker.", labels=["worker"]
        )
        p_waiting = GaugeMetricFamily(
            "pagemesh_num_requests_waiting", "Requests waiting on each worker.", labels=["worker"]
        )
        p_usage = GaugeMetricFamily(
            "pagemesh_kv_cache_usage_ratio", "Used KV-cache pages / total pages, per worker.", labels=["worker"]
        )
        finished = CounterMetricFamily(
            "pagemesh_worker_requests", "Requests each worker has finished (or handed off).", labels=["worker"]
        )
        feature_cache = GaugeMetricFamily(
            "pagemesh_diffusion_feature_cache_bytes",
            "Bytes the running requests' feature caches hold, per diffusion worker",
            labels=["worker"],
        )
        spec = [
            CounterMetricFamily(f"pagemesh_spec_decode_{name}", doc, labels=["worker"])
            for name, doc in (
                ("verify_passes", "Decode rows verified with n-gram drafts, per worker."),
                ("draft_tokens", "Draft tokens run through the model, per worker."),
                ("accepted_tokens", "Draft tokens accepted (acceptance rate = accepted / draft), per worker."),
            )
        ]
        # vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py): drafts = verifying passes
        vspec = [
            CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=v)
            for name, doc in (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens."),
            )
        ]
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*v, "position"],
        )
        # vLLM's LoRA gauge (the Gateway API inference extension routes by it): its value is the time
        lora_info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"],
        )
        lora_loads = [
            CounterMetricFamily(f"pagemesh_lora_{name}", doc, labels=["worker"])
            for name, doc in (
                ("loads", "LoRA adapters loaded into a slot, per worker."),
                ("evictions", "LoRA adapters evicted from their slot for another, per worker."),
            )
        ]
        now = time.time()
        for w in {w.worker_id: w for w in workers}.values():
            vl = [w.model or self.model_name, w.worker_id]
            if w.lora is not None:
                names = [str(w.lora.max_loras), ",".join(w.lora.waiting), ",".join(w.lora.running), w.worker_id]
                lora_info.add_metric(names, now)
                lora_loads[0].add_metric([w.worker_id], w.lora.loads)
                lora_loads[1].add_metric([w.worker_id], w.lora.evictions)
            running.add_metric(vl, w.running)
            waiting.add_metric(vl, w.waiting)
            p_running.add_metric([w.worker_id], w.running)
            p_waiting.add_metric([w.worker_id], w.waiting)
            finished.add_metric([w.worker_id], w.requests_finished)
            if w.kv is not None:
                ratio = w.kv.used_pages / w.kv.total_pages if w.kv.total_pages else 0.0
                usage.add_metric(vl, ratio)
                p_usage.add_metric([w.worker_id], ratio)
            if w.feature_cache is not None:
                feature_cache.add_metric([w.worker_id], w.feature_cache.bytes)
            if w.speculation is not None:
                s = w.speculation
                for family, vfamily, value in zip(spec, vspec, (s.verify_passes, s.draft_tokens, s.accepted_tokens)):
                    family.add_metric([w.worker_id], value)
                    vfamily.add_metric(vl, value)
                for position, value in enumerate(s.accepted_per_pos):
                    per_pos.add_metric([*vl, str(position)], value)
        yield from (running, waiting, usage, p_running, p_waiting, p_usage, finished, feature_cache, *spec)
        yield from (*vspec, per_pos)
        yield from (lora_info, *lora_loads)
        yield CounterMetricFamily(
            "pagemesh_kv_transfer_bytes",
            "KV-cache bytes sent by all workers.",
            value=sum(w.kv.bytes_sent for w in workers if w.kv is not None),
        )
        yield GaugeMetricFamily(
            "pagemesh_scheduler_queued_requests", "Requests waiting in the scheduler.", value=status.queued
        )
        yield CounterMetricFamily(
            "pagemesh_request_migrations",
            "Requests moved to another worker after losing theirs (worker death), ever.",
            value=status.migrations,
        )
        for name, doc, value in (
            ("batches", "KV-cache event batches the scheduler's prefix index applied, ever.", status.kv_event_batches),
            (
                "malformed",
                "KV-cache event batches the scheduler could not read (that worker's keys dropped, a snapshot asked).",
                status.kv_event_malformed,
            ),
            (
                "resyncs",
                "Snapshots of a worker's KV-cache keys the scheduler asked for (a gap or unreadable).",
                status.kv_event_resyncs,
            ),
        ):
            yield CounterMetricFamily(f"pagemesh_scheduler_kv_event_{name}", doc, value=value)
