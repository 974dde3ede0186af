"""The gateway's metrics registry: vLLM's names and labels, pagemesh's per-worker series, and a
/metrics text that Prometheus' own parser reads back."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagemesh.common.messages import ClusterStatus, KVPoolLoad, TextDelta, WorkerStatus
from pagemesh.gateway.metrics import GatewayMetrics

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def delta(index, ids, finish=None, request_id="r", cached=0, queue=None) -> TextDelta:
    return TextDelta(
        request_id=request_id,
        index=index,
        text="x",
        token_ids=ids,
        logprobs=None,
        finish_reason=finish,
        prompt_tokens=7,
        completion_tokens=len(ids),
        cached_tokens=cached,
        queue_time_s=queue,
    )


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}, through prometheus-client's parser of the text."""
    out = {}
    for family in text_string_to_metric_families(m.render()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_timer_observes_vllm_histograms_and_counters():
    m = GatewayMetrics(MODEL)
    timer = m.request(arrival=100.0)
    timer.on_delta(delta(0, [1], cached=4, queue=0.125), 100.5)  # TTFT 0.5, prefill 0.375
    timer.on_delta(delta(1, [2]), 100.5)  # choice 1's first delta: no inter-token gap yet
    timer.on_delta(delta(0, [3, 4]), 100.625)  # ITL 0.125
    timer.on_delta(delta(0, [], "stop"), 100.75)
    timer.on_delta(delta(1, [5], "length"), 100.875)  # ITL 0.375
    timer.on_finished(101.0)
    v = m.value
    assert (v("vllm:time_to_first_token_seconds_count"), v("vllm:time_to_first_token_seconds_sum")) == (1, 0.5)
    assert (v("vllm:inter_token_latency_seconds_count"), v("vllm:inter_token_latency_seconds_sum")) == (2, 0.5)
    assert v("vllm:time_per_output_token_seconds_sum") == 0.5
    assert (v("vllm:e2e_request_latency_seconds_count"), v("vllm:e2e_request_latency_seconds_sum")) == (1, 1.0)
    assert v("vllm:request_queue_time_seconds_sum") == 0.125
    assert v("vllm:request_prefill_time_seconds_sum") == 0.375
    assert v("vllm:request_decode_time_seconds_sum") == 0.5
    assert v("vllm:request_inference_time_seconds_sum") == 0.875
    assert v("vllm:prompt_tokens_total") == 7
    assert v("vllm:generation_tokens_total") == 5
    assert v("vllm:request_generation_tokens_sum") == 5
    assert v("vllm:request_max_num_generation_tokens_sum") == 3
    assert v("vllm:prefix_cache_queries_total") == 7
    assert v("vllm:prefix_cache_hits_total") == 4
    assert v("vllm:request_success_total", finished_reason="stop") == 1
    assert v("vllm:request_success_total", finished_reason="length") == 1
    # cumulative buckets: TTFT 0.5 is in le=0.5 and above, not in le=0.25
    assert v("vllm:time_to_first_token_seconds_bucket", le="0.25") == 0
    assert v("vllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert v("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 1


def test_a_batch_of_prompts_counts_each_prompt_and_its_cache_hits_once():
    m = GatewayMetrics(MODEL)
    timer = m.request(arrival=0.0)
    timer.on_delta(delta(0, [1], request_id="a", cached=2), 1.0)
    timer.on_delta(delta(0, [2], request_id="a", cached=2), 1.5)
    timer.on_delta(delta(1, [3], request_id="b", cached=0), 1.5)
    assert m.value("vllm:prompt_tokens_total") == 14
    assert m.value("vllm:prefix_cache_queries_total") == 14
    assert m.value("vllm:prefix_cache_hits_total") == 2
    assert m.value("vllm:request_prompt_tokens_count") == 2


def test_aborts_are_counted_by_reason_and_as_vllm_abort_finishes():
    m = GatewayMetrics(MODEL)
    m.aborted("client_disconnected")
    m.aborted("client_disconnected")
    m.aborted("timeout")
    s = samples(m)
    assert s[("pagemesh_requests_aborted_total", (("reason", "client_disconnected"),))] == 2
    assert s[("pagemesh_requests_aborted_total", (("reason", "timeout"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))] == 3


STATUS = ClusterStatus(
    ready=True,
    workers=[
        WorkerStatus(
            worker_id="p0",
            kind="llm",
            role="prefill",
            alive=True,
            running=1,
            waiting=2,
            requests_finished=3,
            kv=KVPoolLoad(free_pages=0, used_pages=25, total_pages=100, bytes_sent=4096, bytes_received=0),
            model=MODEL,
        ),
        WorkerStatus(
            worker_id="d0",
            kind="llm",
            role="decode",
            alive=True,
            running=3,
            waiting=0,
            requests_finished=0,
            kv=KVPoolLoad(free_pages=0, used_pages=0, total_pages=0, bytes_sent=1024, bytes_received=4096),
            model=MODEL,
        ),
        WorkerStatus(
            worker_id="img0",
            kind="diffusion",
            role="mixed",
            alive=True,
            running=1,
            waiting=0,
            requests_finished=0,
            kv=None,
            model="digits-dit",
        ),
    ],
    queued=5,
    migrations=2,
    kv_event_batches=40,
    kv_event_malformed=1,
    kv_event_resyncs=3,
)


def test_cluster_status_under_vllm_and_pagemesh_names():
    m = GatewayMetrics(MODEL)
    m.update_cluster(STATUS)
    text = m.render()
    for line in [
        f'vllm:num_requests_running{{engine="p0",model_name="{MODEL}"}} 1.0',
        f'vllm:num_requests_waiting{{engine="p0",model_name="{MODEL}"}} 2.0',
        f'vllm:kv_cache_usage_perc{{engine="p0",model_name="{MODEL}"}} 0.25',
        f'vllm:kv_cache_usage_perc{{engine="d0",model_name="{MODEL}"}} 0.0',
        'vllm:num_requests_running{engine="img0",model_name="digits-dit"} 1.0',
        'pagemesh_num_requests_running{worker="p0"} 1.0',
        'pagemesh_num_requests_waiting{worker="p0"} 2.0',
        'pagemesh_kv_cache_usage_ratio{worker="p0"} 0.25',
        'pagemesh_kv_cache_usage_ratio{worker="d0"} 0.0',
        'pagemesh_worker_requests_total{worker="p0"} 3.0',
        "pagemesh_kv_transfer_bytes_total 5120.0",
        "pagemesh_scheduler_queued_requests 5.0",
        "pagemesh_request_migrations_total 2.0",
        "pagemesh_scheduler_kv_event_batches_total 40.0",
        "pagemesh_scheduler_kv_event_malformed_total 1.0",
        "pagemesh_scheduler_kv_event_resyncs_total 3.0",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "# TYPE vllm:request_success_total counter",
    ]:
        assert line + "\n" in text, line
    assert 'kv_cache_usage_perc{engine="img0"' not in text  # a diffusion worker has no KV pool
    m.update_cluster(None)  # the scheduler did not answer: no stale series
    assert "engine=" not in m.render() and "worker=" not in m.render()
    assert "pagemesh_kv_transfer_bytes_total" not in m.render()


def test_the_text_parses_and_has_no_created_series():
    m = GatewayMetrics(MODEL)
    m.update_cluster(STATUS)
    m.request(0.0).on_delta(delta(0, [1], finish="stop"), 0.5)
    names = {name for name, _ in samples(m)}
    assert "vllm:request_success_total" in names
    assert not any(name.endswith("_created") for name in names)


def test_image_requests_count_the_blocks_computed_and_those_feature_caches_skipped():
    metrics = GatewayMetrics()
    metrics.image_request(200, 0.5, images=2, steps=25, blocks=(300, 100))
    metrics.image_request(200, 0.4, images=1, steps=25, blocks=(200, 0))
    metrics.image_request(400)
    s = samples(metrics)
    assert s[("pagemesh_diffusion_blocks_total", (("outcome", "computed"),))] == 500
    assert s[("pagemesh_diffusion_blocks_total", (("outcome", "skipped"),))] == 100
    assert s[("pagemesh_denoising_steps_total", ())] == 75
    assert s[("pagemesh_image_requests_total", (("status", "200"),))] == 2
    assert s[("pagemesh_image_requests_total", (("status", "400"),))] == 1
    assert s[("pagemesh_image_request_latency_seconds_count", ())] == 2
