"""The Prometheus text writer and the gateway's metrics, line by line."""

from __future__ import annotations

from common.messages import ClusterStatus, KVPoolLoad, TextDelta, WorkerStatus
from gateway.metrics import Counter, GatewayMetrics, Gauge, Histogram, render


def test_histogram_text_is_cumulative_with_inf_sum_and_count():
    h = Histogram("lat_seconds", "Latency.", [0.1, 1, 0.5])
    for value in (0.05, 0.1, 0.3, 2.0):
        h.observe(value)
    assert render([h]) == (
        "# HELP lat_seconds Latency.\n"
        "# TYPE lat_seconds histogram\n"
        'lat_seconds_bucket{le="0.1"} 2\n'
        'lat_seconds_bucket{le="0.5"} 3\n'
        'lat_seconds_bucket{le="1.0"} 3\n'
        'lat_seconds_bucket{le="+Inf"} 4\n'
        "lat_seconds_sum 2.45\n"
        "lat_seconds_count 4\n"
    )


def test_counter_and_gauge_labels_are_escaped():
    c = Counter("done_total", "Done.\nTwo lines.")
    c.inc(finish_reason="stop")
    c.inc(2, finish_reason="stop")
    c.inc(finish_reason='we"ird\\')
    g = Gauge("usage_ratio", "Usage.")
    g.replace({(("worker", "w0"),): 0.25})
    assert render([c, g]) == (
        "# HELP done_total Done.\\nTwo lines.\n"
        "# TYPE done_total counter\n"
        'done_total{finish_reason="stop"} 3\n'
        'done_total{finish_reason="we\\"ird\\\\"} 1\n'
        "# HELP usage_ratio Usage.\n"
        "# TYPE usage_ratio gauge\n"
        'usage_ratio{worker="w0"} 0.25\n'
    )


def delta(index, ids, finish=None) -> TextDelta:
    return TextDelta(
        request_id="r",
        index=index,
        text="x",
        token_ids=ids,
        logprobs=None,
        finish_reason=finish,
        prompt_tokens=7,
        completion_tokens=len(ids),
    )


def test_request_timer_observes_ttft_itl_e2e_and_counts():
    m = GatewayMetrics()
    timer = m.request(arrival=100.0)
    timer.on_delta(delta(0, [1]), 100.5)  # TTFT 0.5
    timer.on_delta(delta(1, [2]), 100.5)  # choice 1's first delta: no inter-token gap yet
    timer.on_delta(delta(0, [3, 4]), 100.6)  # ITL 0.1
    timer.on_delta(delta(0, [], "stop"), 100.7)
    timer.on_delta(delta(1, [5], "length"), 100.9)  # ITL 0.4
    timer.on_finished(101.0)
    assert (m.ttft.count, m.ttft.sum) == (1, 0.5)
    assert m.itl.count == 2 and abs(m.itl.sum - 0.5) < 1e-9
    assert (m.e2e.count, m.e2e.sum) == (1, 1.0)
    assert m.queue_time.count == 0
    assert m.prompt_tokens.values == {(): 7}
    assert m.generation_tokens.values == {(): 5}
    assert m.success.values == {(("finish_reason", "stop"),): 1, (("finish_reason", "length"),): 1}


def test_cluster_status_gauges_and_kv_bytes():
    m = GatewayMetrics()
    m.update_cluster(
        ClusterStatus(
            ready=True,
            workers=[
                WorkerStatus(
                    worker_id="p0",
                    kind="llm",
                    role="prefill",
                    alive=True,
                    running=1,
                    waiting=2,
                    requests_finished=0,
                    kv=KVPoolLoad(free_pages=0, used_pages=25, total_pages=100, bytes_sent=4096, bytes_received=0),
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
                ),
            ],
            queued=5,
            migrations=2,
        )
    )
    text = m.render()
    for line in [
        'pagemesh_num_requests_running{worker="p0"} 1',
        'pagemesh_num_requests_waiting{worker="p0"} 2',
        'pagemesh_kv_cache_usage_ratio{worker="p0"} 0.25',
        'pagemesh_kv_cache_usage_ratio{worker="d0"} 0.0',
        "pagemesh_kv_transfer_bytes_total 5120",
        "pagemesh_scheduler_queued_requests 5",
        "pagemesh_request_migrations_total 2",
        "# TYPE pagemesh_time_to_first_token_seconds histogram",
        "# TYPE pagemesh_request_success_total counter",
        'pagemesh_request_queue_time_seconds_bucket{le="+Inf"} 0',
    ]:
        assert line + "\n" in text
    m.update_cluster(None)  # the scheduler did not answer: no stale series
    assert "worker=" not in m.render() and "pagemesh_kv_transfer_bytes_total 5120" not in m.render()


def test_image_requests_count_the_blocks_computed_and_those_feature_caches_skipped():
    metrics = GatewayMetrics()
    metrics.image_request(200, 0.5, images=2, steps=25, blocks=(300, 100))
    metrics.image_request(200, 0.4, images=1, steps=25, blocks=(200, 0))
    metrics.image_request(400)
    text = metrics.render()
    assert 'pagemesh_diffusion_blocks_total{outcome="computed"} 500' in text
    assert 'pagemesh_diffusion_blocks_total{outcome="skipped"} 100' in text
    assert "pagemesh_denoising_steps_total 75" in text
