"""One simulation from plain settings: the topology, the engine's step limits, the page pool,
the cost model and the workload → the summary `pagemesh bench` prints (bench/loadgen/metrics.py)
plus what only a simulation sees (KV use, preemptions, busy time per worker)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagemesh.bench.loadgen.metrics import summarize
from pagemesh.bench.simulator.cluster import Cluster, ClusterSpec, roles
from pagemesh.bench.simulator.cost import LINKS
from pagemesh.bench.simulator.worker import WorkerSpec
from pagemesh.bench.simulator.workload import SimRequest, WorkloadSpec, generate
from pagemesh.workers.engine.scheduler import StepSchedulerConfig


@dataclass(frozen=True)
class SimSettings:
    mixed: int = 1
    prefill: int = 0
    decode: int = 0
    page_size: int = 16
    num_pages: int = 4096  # per worker
    page_bytes: int = 0  # 0: from the cost model's kv bytes per token (roofline) or the CPU model
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the engine's defaults (workers/engine/config.py)
    max_prefill_chunk: int = 512
    max_num_partial_prefills: int = 4
    long_prefill_threshold: int = 327  # 4% of an 8192-token context
    batching: str = "iteration"
    prefix_caching: bool = True
    link: str = "loopback"
    request_overhead_s: float = 0.0  # before a request reaches the scheduler (HTTP, gateway, tokenizer)
    step_jitter: bool = True  # draw each step's jitter from a MeshStepCost's (per-role, in-mesh) ratios
    host_clock_s: float | None = None  # replay a MeshStepCost's host slowdown aligned to its trace's clock
    workload: WorkloadSpec = WorkloadSpec()

    def with_knob(self, name: str, value) -> SimSettings:
        """A copy with one knob changed (the sweep's axis): a field here or of the workload."""
        if name in WorkloadSpec.__dataclass_fields__:
            kind = type(getattr(self.workload, name))
            return replace(self, workload=replace(self.workload, **{name: kind(value)}))
        if name == "pd":  # "P:D", e.g. "1:3"
            p, d = (int(x) for x in str(value).split(":"))
            return replace(self, mixed=0, prefill=p, decode=d)
        kind = type(getattr(self, name))
        return replace(self, **{name: kind(value)})


def cluster_spec(settings: SimSettings, page_bytes: int) -> ClusterSpec:
    step = StepSchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_prefill_chunk=min(settings.max_prefill_chunk, settings.max_num_batched_tokens),
        max_num_partial_prefills=settings.max_num_partial_prefills,
        long_prefill_threshold=settings.long_prefill_threshold,
        batching=settings.batching,
    )
    workers = tuple(
        WorkerSpec(wid, role, settings.page_size, settings.num_pages, page_bytes, step, settings.prefix_caching)
        for wid, role in roles(settings.mixed, settings.prefill, settings.decode)
    )
    return ClusterSpec(
        workers=workers,
        transfer=LINKS[settings.link],
        request_overhead_s=settings.request_overhead_s,
        step_jitter=settings.step_jitter,
        host_clock_s=settings.host_clock_s,
    )


def simulate(
    settings: SimSettings,
    step_time,
    kv_bytes_per_token: int,
    goodput_ms: dict[str, float] | None = None,
    requests: list[SimRequest] | None = None,
) -> dict:
    """Run one simulation; returns the loadgen summary plus `sim_*` figures. `step_time`: a
    function of the step's shape for every worker, or a MeshStepCost (a model per role)."""
    page_bytes = settings.page_bytes or kv_bytes_per_token * settings.page_size
    cluster = Cluster(cluster_spec(settings, page_bytes), step_time, seed=settings.workload.seed)
    requests = requests if requests is not None else generate(settings.workload)
    traces = cluster.run(requests)
    results = [t.result() for t in traces]
    done = [r for r in results if r.success]
    end = max((r.start + r.latency for r in done), default=1.0)
    summary = summarize(results, max(end, 1e-9), count_tokens=len, goodput_ms=goodput_ms)
    workers = cluster.workers.values()
    summary |= {
        "sim_virtual_s": cluster.loop.now,
        "sim_events": cluster.loop.events_run,
        "sim_preemptions": sum(w.scheduler.num_preemptions for w in workers),
        "sim_max_kv_used_pages": max((w.max_used_pages for w in workers), default=0),
        "sim_kv_pages_left_in_use": sum(cluster.kv_pages_in_use().values()),
        "sim_busy_fraction": {w.spec.worker_id: w.busy_s / max(cluster.loop.now, 1e-9) for w in workers},
        "sim_kv_bytes_sent": sum(w.bytes_sent for w in workers),
    }
    return summary


def meets(summary: dict, slos_ms: dict[str, float], quantile: str = "p99") -> bool:
    """Every SLO met at the quantile (e.g. p99 TTFT <= 500 ms), and nothing failed."""
    if summary["failed"]:
        return False
    return all(summary[f"{quantile}_{name}_ms"] <= ms for name, ms in slos_ms.items())


def find_smallest(
    base: SimSettings, step_time, kv_bytes_per_token: int, slos_ms: dict[str, float], max_workers: int = 16
) -> tuple[SimSettings, dict] | None:
    """The smallest cluster (fewest workers; at equal size mixed first, then P:D splits by
    fewest prefill) meeting the SLOs at p99 for the workload. None if up to max_workers fail."""
    for total in range(1, max_workers + 1):
        candidates = [replace(base, mixed=total, prefill=0, decode=0)]
        candidates += [replace(base, mixed=0, prefill=p, decode=total - p) for p in range(1, total)]
        for settings in candidates:
            summary = simulate(settings, step_time, kv_bytes_per_token)
            if meets(summary, slos_ms):
                return settings, summary
    return None


def describe(settings: SimSettings) -> str:
    if settings.mixed:
        return f"{settings.mixed} mixed"
    return f"{settings.prefill}P+{settings.decode}D"
