"""bench/serving_compare.py: rounds alternate the systems and combine into the median round."""

from pagemesh.bench.serving_compare import combine_rounds, round_order, table


def _run(tok_s: float, ttft: float) -> dict:
    point = {"output_throughput": tok_s, "median_ttft_ms": ttft, "p99_itl_ms": 20.0, "median_tpot_ms": 10.0}
    return {"status": "ok", "points": {8: point}, "load_before": "1.0", "load_after": "1.2"}


def test_rounds_rotate_the_order_so_no_system_always_runs_first():
    names = ["pagemesh mixed", "vLLM CPU bf16", "llama.cpp Q4_1"]
    orders = [round_order(names, r) for r in range(3)]
    assert orders == [
        ["pagemesh mixed", "vLLM CPU bf16", "llama.cpp Q4_1"],
        ["vLLM CPU bf16", "llama.cpp Q4_1", "pagemesh mixed"],
        ["llama.cpp Q4_1", "pagemesh mixed", "vLLM CPU bf16"],
    ]
    assert [order[0] for order in orders] == names


def test_the_median_round_keeps_its_own_latencies_and_the_range_of_all_rounds():
    row = combine_rounds([_run(300, 250), _run(380, 200), _run(340, 230)])
    point = row["points"][8]
    assert row["rounds"] == 3
    assert point["output_throughput"] == 340 and point["median_ttft_ms"] == 230
    assert point["throughput_range"] == (300, 380)


def test_failed_rounds_are_left_out_and_a_system_that_never_ran_keeps_its_status():
    row = combine_rounds([{"status": "failed: exited"}, _run(300, 250)])
    assert row["rounds"] == 1 and row["points"][8]["output_throughput"] == 300
    assert combine_rounds([{"status": "not available: missing x"}]) == {"status": "not available: missing x"}


def test_the_table_shows_the_range_only_when_there_were_several_rounds():
    one = {"a": combine_rounds([_run(300, 250)])}
    several = {"a": combine_rounds([_run(300, 250), _run(380, 200)])}
    assert "| a | 8 | 300 | — | 1.00 |" in table(one, [8], "a")
    assert "| a | 8 | 300 | 300–380 | 1.00 |" in table(several, [8], "a")
