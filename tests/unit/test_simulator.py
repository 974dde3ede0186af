"""`pagemesh simulate`: deterministic virtual time over the mesh's own scheduling code."""

import dataclasses
import json

import numpy as np
import pytest

from pagemesh.bench.simulator.calibrate import fit_trace, samples_from_trace
from pagemesh.bench.simulator.clock import EventLoop
from pagemesh.bench.simulator.cost import GPUS, LinearStepCost, RooflineStepCost, StepShape, model_shape
from pagemesh.bench.simulator.main import main as simulate_main
from pagemesh.bench.simulator.role_cost import HostSlowdown, MeshStepCost, RoleStepCost, TracedStep
from pagemesh.bench.simulator.run import SimSettings, find_smallest, meets, simulate
from pagemesh.bench.simulator.tail import clock_offset
from pagemesh.bench.simulator.worker import shape_of
from pagemesh.bench.simulator.workload import WorkloadSpec, generate
from pagemesh.services.scheduler.placement import Placer
from pagemesh.workers.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from pagemesh.workers.engine.step_trace import StepTrace

# a CPU-like step: 12 ms, plus per prompt token and per decode row
COST = LinearStepCost(0.012, 0.0001, 0.0, 0.0003, 1e-7)
KV_BYTES = 23040  # SmolLM2-135M, bf16, per token


def small(**changes) -> SimSettings:
    workload = WorkloadSpec(num_requests=40, rate=8.0, input_len=96, output_len=24, input_spread=0.5, seed=3)
    return dataclasses.replace(SimSettings(num_pages=512, workload=workload), **changes)


def test_events_run_in_time_order_and_ties_in_the_order_scheduled():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("b"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append("a2")))
    loop.run()
    assert seen == ["a", "a2", "b", "c"] and loop.now == 2.0
    with pytest.raises(ValueError):
        loop.at(1.0, lambda: None)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first, again = simulate(small(), COST.step_time, KV_BYTES), simulate(small(), COST.step_time, KV_BYTES)
    assert first == again
    other = simulate(small(workload=dataclasses.replace(small().workload, seed=4)), COST.step_time, KV_BYTES)
    assert other["median_ttft_ms"] != first["median_ttft_ms"]


@pytest.mark.parametrize("topology", [dict(mixed=1), dict(mixed=2), dict(mixed=0, prefill=1, decode=1)])
def test_every_request_completes_with_every_token_and_no_page_is_left(topology):
    summary = simulate(small(**topology), COST.step_time, KV_BYTES)
    assert summary["completed"] == 40 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 40 * 24
    assert summary["sim_kv_pages_left_in_use"] == 0
    if topology.get("prefill"):
        assert summary["sim_kv_bytes_sent"] > 0  # the prompts' pages crossed to the decode worker
    else:
        assert summary["sim_kv_bytes_sent"] == 0


def test_a_short_pool_preempts_and_still_finishes_everything():
    summary = simulate(
        small(num_pages=40, workload=dataclasses.replace(small().workload, rate=1000.0)), COST.step_time, KV_BYTES
    )
    assert summary["sim_preemptions"] > 0
    assert summary["completed"] == 40 and summary["sim_kv_pages_left_in_use"] == 0


def test_the_simulation_runs_the_engine_scheduler_and_the_placement_the_workers_run(monkeypatch):
    calls = {"schedule": 0, "place": 0}
    schedule, place = Scheduler.schedule, Placer.place

    def counting_schedule(self):
        calls["schedule"] += 1
        return schedule(self)

    def counting_place(self, *args):
        calls["place"] += 1
        return place(self, *args)

    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    monkeypatch.setattr(Placer, "place", counting_place)
    summary = simulate(small(mixed=2), COST.step_time, KV_BYTES)
    assert summary["completed"] == 40
    assert calls["place"] >= 40  # every request was placed by the real placer
    assert calls["schedule"] > 24  # every step was planned by the real engine scheduler


def test_the_step_shape_comes_from_the_plan():
    plan = StepPlan(num_decodes=2)
    seq = type("Seq", (), {"num_tokens": 0})
    plan.chunks = [ScheduledChunk(seq, 99, 1), ScheduledChunk(seq, 9, 1), ScheduledChunk(seq, 32, 64)]
    assert shape_of(plan) == StepShape(
        prefill_tokens=64, prefill_attention=64 * (32 + 32), decode_rows=2, decode_context=100 + 10
    )


def test_the_linear_fit_recovers_the_coefficients_of_its_samples():
    shapes = [StepShape(p, p * c, d, d * c) for p in (0, 64, 512) for d in (0, 8, 32) for c in (16, 256) if p or d]
    samples = [(s, COST.step_time(s)) for s in shapes]
    fitted = LinearStepCost.fit(samples)
    for shape in shapes:
        assert fitted.step_time(shape) == pytest.approx(COST.step_time(shape), rel=1e-6)
    assert min(getattr(fitted, f) for f in ("base_s", "per_prefill_token_s", "per_decode_row_s")) >= 0


def test_the_gpu_roofline_is_memory_bound_for_decodes_and_compute_bound_for_prompts():
    cost = RooflineStepCost(GPUS["h200"], model_shape("llama-3.1-8b"))
    decode = cost.step_time(StepShape(decode_rows=1, decode_context=512)) - GPUS["h200"].step_overhead_s
    assert decode == pytest.approx(cost.weight_bytes / (4.8e12 * 0.75), rel=0.05)  # weights read once
    prefill = cost.step_time(StepShape(prefill_tokens=4096, prefill_attention=4096 * 2048))
    assert prefill > 20 * decode
    tp2 = RooflineStepCost(GPUS["h200"], model_shape("llama-3.1-8b"), tp=2)
    assert tp2.kv_pages(16) > 2 * cost.kv_pages(16)  # the second GPU's memory holds no second copy of weights


def test_find_returns_the_smallest_cluster_that_meets_the_slos():
    base = small(workload=dataclasses.replace(small().workload, rate=80.0, num_requests=60))
    slos = {"ttft": 150.0, "tpot": 30.0}
    found = find_smallest(base, COST.step_time, KV_BYTES, slos, max_workers=6)
    assert found is not None
    settings, summary = found
    assert meets(summary, slos)
    size = settings.mixed + settings.prefill + settings.decode
    assert size > 1  # one worker cannot keep up at this rate ...
    smaller = simulate(dataclasses.replace(base, mixed=size - 1, prefill=0, decode=0), COST.step_time, KV_BYTES)
    assert not meets(smaller, slos)  # ... and the next smaller mixed cluster misses


def test_workloads_share_prefixes_when_asked():
    spec = WorkloadSpec(num_requests=6, shared_prefix=32, prefix_groups=2, input_len=64, seed=1)
    reqs = generate(spec)
    assert reqs[0].prompt_token_ids[:32] == reqs[2].prompt_token_ids[:32] != reqs[1].prompt_token_ids[:32]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs) and reqs[0].arrival_s == 0.0


def test_a_traced_step_reads_back_as_its_whole_cycle_and_the_fit_recovers_the_cost(tmp_path):
    """The workers' step trace (what bench.simulator.validate fits in-mesh): a step followed at once
    by the next one counts until that one starts (host work included); the last of a busy stretch
    gets the worker's usual gap."""
    trace = StepTrace(tmp_path)
    seq = type("Seq", (), {"num_tokens": 0})
    start, shapes = 100.0, []
    for rows in (1, 4, 16, 1, 8, 32) * 3:
        plan = StepPlan(num_decodes=rows)
        plan.chunks = [ScheduledChunk(seq, 50 + i, 1) for i in range(rows)]
        seconds = COST.step_time(shape_of(plan)) - 0.002  # the step; 2 ms of host work follow it
        trace.record(plan, start, seconds)
        shapes.append(shape_of(plan))
        start += seconds + 0.002
    trace.file.close()
    samples = samples_from_trace(tmp_path)
    assert [s for s, _ in samples] == shapes
    assert [t for _, t in samples] == pytest.approx([COST.step_time(s) for s in shapes])
    fitted = fit_trace(tmp_path)
    assert fitted.roles == {}  # the trace did not say the worker's role: only the pooled model
    assert fitted.pooled.step_time(shapes[2]) == pytest.approx(COST.step_time(shapes[2]), rel=1e-3)


def test_the_fixed_request_overhead_delays_the_first_token_by_itself():
    base = simulate(small(), COST.step_time, KV_BYTES)
    later = simulate(dataclasses.replace(small(), request_overhead_s=0.05), COST.step_time, KV_BYTES)
    assert later["median_ttft_ms"] == pytest.approx(base["median_ttft_ms"] + 50, abs=5)


# ---- a cost model per worker role (bench/simulator/role_cost.py) ------------------------------
PREFILL_COST = LinearStepCost(0.004, 0.0008, 0.0, 0.0, 0.0)  # 0.8 ms a prompt token
DECODE_COST = LinearStepCost(0.015, 0.0, 0.0, 0.001, 2e-7)


def write_trace(path, role, steps):
    """A worker's step trace as workers/engine/step_trace.py writes it: [(start, seconds, shape)]."""
    lines = [{"role": role}] + [{"start": t, "seconds": sec, **dataclasses.asdict(sh)} for t, sec, sh in steps]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_each_role_gets_the_model_of_its_own_steps_and_the_slowdown_while_another_steps(tmp_path):
    """A decode worker steps back to back from 0 to 6 s; the prefill worker's prompts run 25%
    slower while it does (0-6 s) than alone (after 10 s). The fit finds each role's coefficients,
    the prefill role's contention and none for the decode role (its steps never slowed)."""
    decode, t = [], 0.0
    while t < 6.0:
        shape = StepShape(decode_rows=1 + int(t * 5) % 8, decode_context=(1 + int(t * 5) % 8) * (200 + int(t * 40)))
        decode.append((t, DECODE_COST.step_time(shape), shape))
        t += DECODE_COST.step_time(shape)
    prefill = []
    for i, start in enumerate([0.5, 1.5, 2.5, 3.5, 4.5, 10.5, 11.5, 12.5, 13.5, 14.5]):
        shape = StepShape(prefill_tokens=(64, 128, 256, 384, 512)[i % 5])
        slowdown = 1.25 if start < 6 else 1.0
        prefill.append((start, PREFILL_COST.step_time(shape) * slowdown, shape))
    write_trace(tmp_path / "steps-1.jsonl", "decode", decode)
    write_trace(tmp_path / "steps-2.jsonl", "prefill", prefill)
    model = fit_trace(tmp_path, tmp_path / "mesh.json")
    assert set(model.roles) == {"prefill", "decode"}
    p, d = model.for_role("prefill"), model.for_role("decode")
    assert p.contention == pytest.approx(0.25, rel=0.02) and d.contention == pytest.approx(0.0, abs=1e-6)
    for shape in (StepShape(prefill_tokens=200), StepShape(prefill_tokens=64)):
        assert p.step_time(shape) == pytest.approx(PREFILL_COST.step_time(shape), rel=0.02)
        assert p.step_time(shape, others_busy=1) == pytest.approx(1.25 * PREFILL_COST.step_time(shape), rel=0.02)
    shape = StepShape(decode_rows=5, decode_context=1500)
    assert d.step_time(shape) == pytest.approx(DECODE_COST.step_time(shape), rel=1e-3)
    # the prefill worker never ran decode rows: that coefficient comes from the pooled fit
    assert p.linear.per_decode_row_s == model.pooled.linear.per_decode_row_s
    assert model.for_role("mixed") is model.pooled  # a role the trace did not have
    assert MeshStepCost.load(tmp_path / "mesh.json") == model


def constant(seconds: float) -> RoleStepCost:
    return RoleStepCost(LinearStepCost(seconds, 0.0, 0.0, 0.0, 0.0))


def test_the_simulation_times_each_worker_by_the_model_of_its_role():
    """Prefill steps 80 ms, decode steps 8 ms: a lone request's first token waits one prefill
    step and its next tokens one decode step each; swapped roles swap the figures."""
    lone = dataclasses.replace(small().workload, num_requests=4, rate=1.0, input_spread=0.0)
    settings = small(mixed=0, prefill=1, decode=1, workload=lone)
    pooled = constant(1.0)  # a role without a model of its own would take 1 s a step
    summary = simulate(settings, MeshStepCost(pooled, {"prefill": constant(0.08), "decode": constant(0.008)}), KV_BYTES)
    swapped = simulate(settings, MeshStepCost(pooled, {"prefill": constant(0.008), "decode": constant(0.08)}), KV_BYTES)
    assert summary["completed"] == swapped["completed"] == 4
    assert 80 < summary["median_ttft_ms"] < 80 + 5 and 8 <= summary["median_tpot_ms"] < 8 + 1
    assert 8 < swapped["median_ttft_ms"] < 8 + 5 and 80 <= swapped["median_tpot_ms"] < 80 + 1
    mixed = simulate(small(workload=lone), MeshStepCost(pooled, {"prefill": constant(0.08)}), KV_BYTES)
    assert mixed["median_tpot_ms"] > 900  # the mixed worker took the pooled model


def test_the_slowdown_applies_while_another_worker_steps_and_the_jitter_is_seeded():
    lone = dataclasses.replace(small().workload, num_requests=4, rate=1.0, input_spread=0.0)
    settings = small(mixed=0, prefill=1, decode=1, workload=lone)
    slowed = RoleStepCost(LinearStepCost(0.08, 0.0, 0.0, 0.0, 0.0), contention=0.5)
    alone = simulate(settings, MeshStepCost(constant(0.008), {"prefill": slowed}), KV_BYTES)
    assert 80 < alone["median_ttft_ms"] < 85  # requests 1 s apart: the decode worker is idle by then
    busy = dataclasses.replace(lone, output_len=400)  # 3.2 s of decodes each: later prompts meet them
    loaded = simulate(
        dataclasses.replace(settings, workload=busy), MeshStepCost(constant(0.008), {"prefill": slowed}), KV_BYTES
    )
    assert 120 < loaded["median_ttft_ms"] < 125  # the first prompt ran alone (80 ms), the other three at 120
    assert loaded["mean_ttft_ms"] == pytest.approx((80 + 3 * 120) / 4, abs=4)
    jittery = MeshStepCost(RoleStepCost(COST, 0.0, tuple(0.5 + i / 100 for i in range(101))))
    first, again = simulate(small(), jittery, KV_BYTES), simulate(small(), jittery, KV_BYTES)
    assert first == again
    other = simulate(small(workload=dataclasses.replace(small().workload, seed=4)), jittery, KV_BYTES)
    assert other["median_tpot_ms"] != first["median_tpot_ms"]
    steady = simulate(dataclasses.replace(small(), step_jitter=False), jittery, KV_BYTES)
    assert steady == simulate(small(), MeshStepCost(RoleStepCost(COST)), KV_BYTES)


def test_the_fit_finds_the_hosts_slow_seconds_and_keeps_them_out_of_the_step_model(tmp_path):
    """One decode worker steps back to back for 20 s; from 6 s to 10 s every step runs 1.5x
    slower (the host is busy elsewhere). The fit gives those seconds a factor of 1.5 and the rest
    1, in order, and the role's model the coefficients of the steps as they run when the host is
    not slowed; without the host term the slow seconds would inflate the model instead."""
    steps, t = [], 0.0
    while t < 20.0:
        rows = 1 + len(steps) % 12
        shape = StepShape(decode_rows=rows, decode_context=rows * 300)
        seconds = DECODE_COST.step_time(shape) * (1.5 if 6.0 <= t < 10.0 else 1.0)
        steps.append((t, seconds, shape))
        t += seconds
    write_trace(tmp_path / "steps-1.jsonl", "decode", steps)
    model = fit_trace(tmp_path)
    factors = model.host.factors
    assert len(factors) == 20 and model.host.window_s == 1.0
    assert factors[6:10] == pytest.approx([1.5] * 4, rel=0.02)
    assert factors[:5] + factors[11:] == pytest.approx([1.0] * 14, rel=0.02)
    shape = StepShape(decode_rows=6, decode_context=1800)
    assert model.for_role("decode").step_time(shape) == pytest.approx(DECODE_COST.step_time(shape), rel=0.02)
    assert fit_trace(tmp_path, host_window_s=None).for_role("decode").step_time(shape) > 1.05 * (
        DECODE_COST.step_time(shape)
    )
    model.save(tmp_path / "mesh.json")
    assert MeshStepCost.load(tmp_path / "mesh.json") == model


def test_the_hosts_slowdown_is_replayed_from_a_seeded_offset_for_every_worker_alike():
    """Every step runs `factor` times its model while the replayed second says so; the offset into
    the recorded seconds comes from the run's seed (the same seed, the same run); turning the
    jitter off turns the host's slowdown off too."""
    lone = dataclasses.replace(small().workload, num_requests=4, rate=1.0, input_spread=0.0)
    settings = small(mixed=0, prefill=1, decode=1, workload=lone)
    roles = {"prefill": constant(0.08), "decode": constant(0.008)}
    doubled = simulate(settings, MeshStepCost(constant(1.0), roles, host=HostSlowdown((2.0,))), KV_BYTES)
    assert 160 < doubled["median_ttft_ms"] < 165 and 16 <= doubled["median_tpot_ms"] < 17
    steady = simulate(
        dataclasses.replace(settings, step_jitter=False),
        MeshStepCost(constant(1.0), roles, host=HostSlowdown((2.0,))),
        KV_BYTES,
    )
    assert 80 < steady["median_ttft_ms"] < 85 and 8 <= steady["median_tpot_ms"] < 9
    stretches = MeshStepCost(RoleStepCost(COST), host=HostSlowdown((1.0,) * 6 + (3.0,) * 2, window_s=0.5))
    first, again = simulate(small(), stretches, KV_BYTES), simulate(small(), stretches, KV_BYTES)
    assert first == again
    # the same requests under other seeds: only where the run enters the recorded seconds changes
    requests = generate(small().workload)
    seeds = [small(workload=dataclasses.replace(small().workload, seed=seed)) for seed in range(4)]
    assert len({simulate(x, stretches, KV_BYTES, requests=requests)["p99_tpot_ms"] for x in seeds}) > 1
    flat = MeshStepCost(RoleStepCost(COST))
    assert len({simulate(x, flat, KV_BYTES, requests=requests)["p99_tpot_ms"] for x in seeds}) == 1
    plain = simulate(small(), MeshStepCost(RoleStepCost(COST)), KV_BYTES)
    assert first["p99_tpot_ms"] > plain["p99_tpot_ms"]  # a request decoded in a slow second pays for it


def test_the_cli_reads_a_per_role_calibration(tmp_path, capsys):
    MeshStepCost(constant(0.02), {"decode": constant(0.01)}).save(tmp_path / "mesh.json")
    simulate_main(["--prefill", "1", "--decode", "1", "--num-requests", "6", "--output-len", "8",
                   "--calibration", str(tmp_path / "mesh.json"), "--out", str(tmp_path / "run")])  # fmt: skip
    assert "fitted per role (decode)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "simulate.json").read_text())["1P+1D"]
    assert summary["completed"] == 6 and 10 <= summary["median_tpot_ms"] < 11


def test_the_tail_analysis_puts_the_clients_clock_on_the_traces():
    """pagemesh.bench.simulator.tail: first tokens reach the client 3 ms after the step that sampled them
    ends; the offset between the two clocks is found from that alone."""
    step_ends = np.cumsum(np.random.default_rng(0).uniform(0.08, 0.3, size=200)) + 5000.0
    sampled = step_ends[[3, 10, 11, 40, 41, 42, 90, 150]]
    firsts = sampled + 0.003 - 4990.0  # the client's clock runs 4990 s behind the trace's
    assert clock_offset(firsts, step_ends) == pytest.approx(4990.0 - 0.003, abs=1e-6)


def test_the_jitter_keeps_the_weight_of_a_rare_long_step():
    """5,000 steps within ±10% of their model and one stall of 18x: drawn jitter averages what
    the steps did (1.003), not the 1.08 that interpolating the top percentile up to the stall
    gave; a model saved on the old percentile grid still draws on that grid."""
    rng = np.random.default_rng(1)
    shape = StepShape(decode_rows=4, decode_context=600)
    ratios = np.append(rng.uniform(0.9, 1.1, 5000), 18.0)
    steps = [TracedStep(shape, COST.step_time(shape) * r) for r in ratios]
    role = RoleStepCost.fit(steps)
    draws = rng.random(200_000)
    drawn = np.array([role.step_time(shape, draw=u) for u in draws]) / role.step_time(shape)
    assert drawn.mean() == pytest.approx(ratios.mean() * COST.step_time(shape) / role.step_time(shape), rel=0.01)
    assert drawn.max() > 5.0  # the stall is still drawn, now and then
    old = RoleStepCost(COST, 0.0, tuple(0.5 + i / 100 for i in range(101)))
    assert old.step_time(shape, draw=0.5) == pytest.approx(COST.step_time(shape))


def test_the_hosts_slowdown_can_be_replayed_on_the_recorded_runs_own_clock(tmp_path):
    """The fit keeps where on the trace's clock each factor's second lay; `host_clock_s` replays
    the slowdown of the very seconds a run was measured in (a second without enough steps is 1)."""
    steps, t = [], 7000.0
    while t < 7020.0:
        shape = StepShape(decode_rows=4, decode_context=1200)
        seconds = DECODE_COST.step_time(shape) * (2.0 if 7006.0 <= t < 7010.0 else 1.0)
        steps.append((t, seconds, shape))
        t += seconds
    write_trace(tmp_path / "steps-1.jsonl", "decode", steps)
    host = fit_trace(tmp_path).host
    assert host.at_clock(7007.5) == pytest.approx(2.0, rel=0.02)
    assert host.at_clock(7002.5) == pytest.approx(1.0, rel=0.02) and host.at_clock(9000.0) == 1.0
    assert HostSlowdown.from_json(json.loads(json.dumps(host.to_json()))) == host
    lone = dataclasses.replace(small().workload, num_requests=3, rate=0.5, input_spread=0.0)
    settings = small(mixed=0, prefill=1, decode=1, workload=lone)
    roles = {"prefill": constant(0.08), "decode": constant(0.008)}
    slow_then_fast = MeshStepCost(constant(1.0), roles, host=HostSlowdown((2.0, 1.0), 100.0, 500.0, (0, 1)))
    slow = simulate(dataclasses.replace(settings, host_clock_s=500.0), slow_then_fast, KV_BYTES)
    fast = simulate(dataclasses.replace(settings, host_clock_s=600.0), slow_then_fast, KV_BYTES)
    assert 160 < slow["median_ttft_ms"] < 165 and 80 < fast["median_ttft_ms"] < 85
    with pytest.raises(ValueError, match="no clock"):
        HostSlowdown((2.0,)).at_clock(0.0)


def test_the_clock_match_searches_only_where_the_run_began():
    """A busier stretch of the trace elsewhere fits the first tokens' gaps as well by chance;
    `within` keeps the search to the stretch where the run is known to have begun."""
    step_ends = np.cumsum(np.random.default_rng(0).uniform(0.08, 0.3, size=200)) + 5000.0
    sampled = step_ends[[3, 10, 11, 40]]
    firsts = sampled + 0.003 - 4990.0
    assert clock_offset(firsts, step_ends, within=(5000.0, 5001.0)) == pytest.approx(4990.0 - 0.003, abs=1e-6)
    assert clock_offset(firsts, step_ends, within=(5010.0, 5020.0)) != pytest.approx(4990.0 - 0.003, abs=1e-6)


def test_recorded_runs_are_placed_on_the_trace_clock_one_after_the_other(tmp_path):
    """validate: a run that recorded its first send on the shared clock (`clock_origin`) is
    taken at its word; runs recorded before that are found by their first tokens, each just after
    the run before it, although the later, busier run would fit the earlier run's gaps too."""
    from pagemesh.bench.simulator.validate import first_sends_on_trace_clock

    rng = np.random.default_rng(2)
    # a sparse stretch (the first run's prompts, 2000-2030 s), then a busy one (2035-2065 s)
    starts = np.concatenate([np.sort(rng.uniform(2000, 2030, 30)), np.sort(rng.uniform(2035, 2065, 3000))])
    shape = StepShape(prefill_tokens=128, prefill_attention=8192)
    write_trace(tmp_path / "steps-1.jsonl", "prefill", [(float(t), 0.05, shape) for t in starts])

    def run(name, sends_on_clock, record_origin):
        origin = float(sends_on_clock[0])
        requests = {
            "starts": [float(t) - origin for t in sends_on_clock],
            # a first token 3-40 ms after its step's end (the trip to the client): first tokens
            # dropped anywhere in the busy stretch would land nearer after some step's end
            "ttfts": (0.05 + rng.uniform(0.003, 0.04, len(sends_on_clock))).tolist(),
            "latencies": [0.5] * len(sends_on_clock),
            "errors": [""] * len(sends_on_clock),
        }
        if record_origin:
            requests["clock_origin"] = origin
        (tmp_path / name).write_text(json.dumps({"points": [{"requests": requests}]}))
        return tmp_path / name

    first = run("a.json", starts[:30:3], record_origin=False)
    second = run("b.json", starts[30::100], record_origin=False)
    found = first_sends_on_trace_clock([first, second], tmp_path)
    # the first run to its first token's trip; the second, among steps 10 ms apart, to within
    # the second that the host's slowdown is kept per
    assert starts[0] - 0.04 <= found[0] <= starts[0] and abs(found[1] - starts[30]) < 1.0
    recorded = run("c.json", starts[30::100] + 0.5, record_origin=True)
    assert first_sends_on_trace_clock([first, recorded], tmp_path)[1] == starts[30] + 0.5
