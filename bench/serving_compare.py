"""pagemesh and its peers side by side on this machine, with one `pagemesh bench` workload.

For each system that is available (pagemesh `up` 1P+1D and `--mixed 1`, llama.cpp's
llama-server, vLLM CPU), one at a time: start it on loopback, send 128-token prompts as token ids
with exactly 128 output tokens (ignore_eos) at concurrency 1, 8 and 32 with prompt caching off,
stop it. HF transformers `generate` with static batches of the same prompts is measured in-process
as the floor (no server). With --rounds R the systems alternate (A-B-A-B, the order rotated each
round), because this machine drifts by 10-20% between quiet runs; each point is then the median
round, with the range of the rounds beside it. Prints one table, how each system ran, and writes
them to --out (docs/perf/cpu.md by default; --no-write leaves it alone).

    python bench/serving_compare.py                         # everything available, one round
    python bench/serving_compare.py --systems "pagemesh mixed,vLLM CPU bf16" --rounds 3 --no-write
    python bench/serving_compare.py --peers-dir /opt/peers --out /tmp/cpu.md

Peers are set up by bench/peers/llama_cpp.sh build and bench/peers/vllm_cpu.sh install/convert
(PEERS_DIR or --peers-dir, default /work/peers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from pagemesh.bench.loadgen import main as bench_main  # noqa: E402

DEFAULT_PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/peers"))
INPUT_LEN = OUTPUT_LEN = 128


@dataclass
class System:
    name: str
    command: list[str]  # {port} is filled in
    ready_path: str  # GET until 200
    needs: list[Path] = field(default_factory=list)
    extra_body: dict = field(default_factory=dict)
    start_timeout_s: float = 300.0
    env: dict = field(default_factory=dict)
    describe: list[str] = field(default_factory=list)  # a command that prints how it runs


def systems(peers_dir: Path) -> list[System]:
    py = sys.executable
    llama = peers_dir / "llama_cpp" / "build" / "bin" / "llama-server"
    f16 = peers_dir / "llama_cpp" / "SmolLM2-135M-Instruct.F16.gguf"
    vllm = peers_dir / "vllm"
    peers_env = {"PEERS_DIR": str(peers_dir)}
    up = [py, "-P", "-m", "pagemesh.services.cli", "up", "--port", "{port}", "--no-enable-prefix-caching"]
    up += ["--diffusion", "0"]
    llama_serve = ["bash", "bench/peers/llama_cpp.sh", "serve", "{port}"]
    llama_describe = ["bash", "bench/peers/llama_cpp.sh", "describe"]

    def llama_cpp(name: str, variant: str, needs: list[Path], env: dict) -> System:
        return System(
            name,
            llama_serve + [variant, "32"],
            "/health",
            needs,
            {"cache_prompt": False},
            180,
            peers_env | env,
            llama_describe + [variant, "32"],
        )

    pagemesh_how = ["echo", "pagemesh (this checkout), bf16, CPU kernels, prefix caching off"]
    dense = ["--quantization", "none"]  # a GGUF serves from its own blocks by default: these rows stay bf16
    return [
        System("pagemesh mixed", up + ["--mixed", "1", *dense], "/ready", describe=pagemesh_how + ["--mixed 1"]),
        System("pagemesh 1P+1D", up + dense, "/ready", describe=pagemesh_how + ["1 prefill + 1 decode"]),
        # the shipped GGUF's Q4_1/Q8_0 blocks as they are (docs/perf/quantization.md), and with an fp8 KV cache
        System(
            "pagemesh mixed gguf",
            up + ["--mixed", "1", "--quantization", "gguf"],
            "/ready",
            describe=pagemesh_how + ["--mixed 1 --quantization gguf"],
        ),
        # the same with each decode step's layers through the Python modules (workers/model/decode_layers.py)
        System(
            "pagemesh mixed gguf python-layers",
            up + ["--mixed", "1", "--quantization", "gguf"],
            "/ready",
            env={"PAGEMESH_DECODE_LAYERS": "0"},
            describe=pagemesh_how + ["--mixed 1 --quantization gguf, PAGEMESH_DECODE_LAYERS=0"],
        ),
        # one worker thread: a loaded machine preempts one of two OpenMP threads at every barrier
        System(
            "pagemesh mixed gguf -t 1",
            up + ["--mixed", "1", "--quantization", "gguf", "--threads-per-worker", "1"],
            "/ready",
            describe=pagemesh_how + ["--mixed 1 --quantization gguf --threads-per-worker 1"],
        ),
        System(
            "pagemesh mixed gguf fp8kv",
            up + ["--mixed", "1", "--quantization", "gguf", "--kv-cache-dtype", "fp8_e4m3"],
            "/ready",
            describe=pagemesh_how + ["--mixed 1 --quantization gguf --kv-cache-dtype fp8_e4m3"],
        ),
        llama_cpp("llama.cpp Q4_1", "q4_1", [llama], {}),
        # Its thread pool spins while it waits: on a loaded 2-core machine one thread can beat two.
        llama_cpp("llama.cpp Q4_1 -t 1", "q4_1", [llama], {"THREADS": "1"}),
        System(
            "vLLM CPU bf16",
            ["bash", "bench/peers/vllm_cpu.sh", "serve", "{port}", "bfloat16"],
            "/health",
            [vllm / "venv" / "bin" / "python", vllm / "SmolLM2-135M-Instruct-hf" / "config.json"],
            {},
            900,
            peers_env,
            ["bash", "bench/peers/vllm_cpu.sh", "describe"],
        ),
        llama_cpp("llama.cpp F16", "f16", [llama, f16], {}),
    ]


def how_it_ran(system: System) -> str:
    """What the system's own script says about how it runs (preloads, threads, slots)."""
    if not system.describe:
        return ""
    done = subprocess.run(
        system.describe, cwd=REPO, capture_output=True, text=True, env=os.environ | system.env, check=False
    )
    return " ".join(done.stdout.split()) or f"(describe failed: {done.stderr.strip()[:200]})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Server:
    """One system's server process (its own process group), logging to a file."""

    def __init__(self, system: System, log: Path):
        self.system, self.port = system, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [part.format(port=self.port) for part in system.command]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | system.env,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.system.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode} while starting")
            if _http_ok(self.url + self.system.ready_path):
                return
            time.sleep(1)
        raise RuntimeError(f"not ready after {self.system.start_timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class PeakMemory:
    """Samples, in a thread, the memory of every process in the server's session (the launcher
    and its children, or the peer's server and its workers): the peak of the summed RSS (shared
    libraries counted once per process, as `ps` does) and of the summed PSS (shared pages split
    between the processes that map them: what the system as a whole holds)."""

    def __init__(self, session: int, every_s: float = 0.5) -> None:
        self.session, self.every_s = session, every_s
        self.rss = self.pss = 0
        self.processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            rss = pss = n = 0
            for proc in psutil.process_iter():
                try:
                    if os.getsid(proc.pid) != self.session:
                        continue
                    info = proc.memory_full_info()
                except (psutil.Error, OSError):
                    continue
                rss, pss, n = rss + info.rss, pss + info.pss, n + 1
            if pss > self.pss:
                self.rss, self.pss, self.processes = rss, pss, n
            self._stop.wait(self.every_s)


def prompts_for(concurrency: int) -> int:
    """Requests per point: 4 one after another, two waves of 8, one wave of 32."""
    return max(4, min(2 * concurrency, 32))


def bench_point(system: System, url: str, concurrency: int, tag: str, results: Path) -> dict:
    out = results / f"{tag}-c{concurrency}.json"
    argv = [
        "--base-url",
        url,
        "--dataset",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--prompt-as-token-ids",
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(prompts_for(concurrency)),
        "--fresh-connection",
        "--label",
        system.name,
        "--extra-body",
        json.dumps(system.extra_body),
        "--result-json",
        str(out),
        "--no-progress",
    ]
    bench_main.main(argv)
    return json.loads(out.read_text())["points"][0]["summary"]


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_system(system: System, concurrencies: list[int], results: Path, round_index: int = 0) -> dict:
    missing = [str(p) for p in system.needs if not p.exists()]
    if missing:
        return {"status": f"not available: missing {', '.join(missing)}"}
    tag = system.name.lower().replace(" ", "-").replace("+", "") + f"-r{round_index}"
    server = Server(system, results / f"{tag}.log")
    row: dict = {"load_before": load_average(), "points": {}}
    try:
        started = time.monotonic()
        server.wait_ready()
        row["start_s"] = time.monotonic() - started
        for c in concurrencies:
            print(f"== {system.name}: concurrency {c}", flush=True)
            with PeakMemory(server.proc.pid) as memory:
                row["points"][c] = bench_point(system, server.url, c, tag, results)
            row["points"][c] |= {"peak_rss": memory.rss, "peak_pss": memory.pss, "processes": memory.processes}
        row["status"] = "ok"
    except SystemExit as e:  # pagemesh bench could not run a point (e.g. the server stopped answering)
        row["status"] = f"failed: pagemesh bench exited with {e.code} (log {server.log.name})"
    except (RuntimeError, OSError) as e:
        row["status"] = f"failed: {e} (log {server.log.name})"
    finally:
        server.stop()
        row["load_after"] = load_average()
    return row


def hf_static(concurrencies: list[int], dtype_name: str) -> dict:
    """HF `generate`, greedy, static batches of the same prompts (prefill timed alone for TTFT)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagemesh.bench.loadgen.datasets import DatasetSpec, conversations
    from pagemesh.common.model_files import default_model_path
    from pagemesh.common.tokenizer import Tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    stream = conversations(DatasetSpec(input_len=INPUT_LEN, output_len=OUTPUT_LEN), Tokenizer.from_path(path))
    row: dict = {"load_before": load_average(), "points": {}, "status": "ok"}

    def generate(batch, new_tokens):
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    generate([list(next(stream).turns[0].user.ids)], 4)  # warm-up
    for c in concurrencies:
        print(f"== HF transformers {dtype_name}: batch {c}", flush=True)
        batch = [list(next(stream).turns[0].user.ids) for _ in range(c)]
        prefill = generate(batch, 1)
        total = generate(batch, OUTPUT_LEN)
        row["points"][c] = {
            "output_throughput": c * OUTPUT_LEN / total,
            "median_ttft_ms": prefill * 1000,
            "p99_itl_ms": None,
            "median_tpot_ms": (total - prefill) / (OUTPUT_LEN - 1) * 1000,
        }
    row["load_after"] = load_average()
    return row


def _fmt(value, unit="") -> str:
    return "—" if value is None else f"{value:,.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"


def combine_rounds(runs: list[dict]) -> dict:
    """One system's rows from several rounds -> one row: per point, the round with the median
    output tok/s (so its latencies are from one run), and the range of tok/s over the rounds."""
    ok = [run for run in runs if run.get("status") == "ok"]
    if not ok:
        return runs[-1] if runs else {"status": "not run"}
    row: dict = {"status": "ok", "rounds": len(ok), "points": {}}
    for c in ok[0]["points"]:
        points = sorted((run["points"][c] for run in ok if c in run["points"]), key=lambda s: s["output_throughput"])
        median = dict(points[(len(points) - 1) // 2])
        median["throughput_range"] = (points[0]["output_throughput"], points[-1]["output_throughput"])
        row["points"][c] = median
    row["load_before"] = " / ".join(str(run.get("load_before")) for run in ok)
    row["load_after"] = " / ".join(str(run.get("load_after")) for run in ok)
    return row


def round_order(names: list[str], round_index: int) -> list[str]:
    """A-B-A-B with the order rotated each round, so no system always runs first (or after the same one)."""
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


def _fmt(value, unit="") -> str:
    return "—" if value is None else f"{value:,.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"


def table(rows: dict[str, dict], concurrencies: list[int], reference: str) -> str:
    ref = rows.get(reference, {}).get("points", {})
    lines = [
        "| system | streams | output tok/s | range over rounds | × ref tok/s | TTFT p50 (ms) | ITL p99 (ms) | "
        "× ref ITL p99 | TPOT p50 (ms) | peak RSS / PSS (GB, processes) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in rows.items():
        if row.get("status") != "ok":
            lines.append(f"| {name} | — | {row.get('status')} | | | | | | | |")
            continue
        for c in concurrencies:
            s, r = row["points"].get(c), ref.get(c)
            if s is None:
                continue
            tok_ratio = f"{s['output_throughput'] / r['output_throughput']:.2f}" if r else "—"
            itl_ratio = (
                f"{s['p99_itl_ms'] / r['p99_itl_ms']:.2f}" if r and s.get("p99_itl_ms") and r.get("p99_itl_ms") else "—"
            )
            low, high = s.get("throughput_range") or (None, None)
            spread = f"{_fmt(low)}–{_fmt(high)}" if low is not None and row.get("rounds", 1) > 1 else "—"
            lines.append(
                f"| {name} | {c} | {_fmt(s['output_throughput'])} | {spread} | {tok_ratio} | "
                f"{_fmt(s['median_ttft_ms'])} | {_fmt(s.get('p99_itl_ms'))} | {itl_ratio} | "
                f"{_fmt(s.get('median_tpot_ms'))} | {_memory(s)} |"
            )
    return "\n".join(lines)


def _memory(point: dict) -> str:
    if not point.get("peak_pss"):
        return "—"
    return f"{point['peak_rss'] / 1e9:.1f} / {point['peak_pss'] / 1e9:.1f} ({point['processes']})"


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {memory_gib:.0f} GiB, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=None, help="comma-separated names (default: all, plus hf-bf16)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--reference", default="pagemesh mixed", help="the row ratios are taken to")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the systems this many times (A-B-A-B)")
    parser.add_argument(
        "--peers-dir", type=Path, default=DEFAULT_PEERS_DIR, help="where bench/peers/*.sh put the peers"
    )
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="raw results and logs (default PEERS_DIR/results)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "perf" / "cpu.md", help="the report to update")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers floor")
    parser.add_argument("--no-write", action="store_true", help="print only; leave --out alone")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wanted = {s.strip() for s in args.systems.split(",")} if args.systems else None
    results = args.results_dir or args.peers_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now().isoformat(timespec="minutes")
    chosen = {system.name: system for system in systems(args.peers_dir) if wanted is None or system.name in wanted}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for round_index in range(args.rounds):
        for name in round_order(list(chosen), round_index):
            print(f"== round {round_index + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append(run_system(chosen[name], concurrencies, results, round_index))
            print(json.dumps({name: runs[name][-1]}, default=str)[:2000], flush=True)
    rows = {name: combine_rounds(runs[name]) for name in chosen}
    how = {name: how_it_ran(system) for name, system in chosen.items()}
    if not args.no_hf and (wanted is None or "hf-bf16" in wanted):
        name = "HF transformers bf16, static batch (offline)"
        rows[name] = hf_static(concurrencies, "bfloat16")
        how[name] = "transformers generate, greedy, static batches, in-process (no server)"
    (results / f"compare-{date}.json").write_text(
        json.dumps({"rows": rows, "runs": runs, "how": how}, indent=2, default=str)
    )
    text = table(rows, concurrencies, args.reference)
    how_text = "\n".join(f"- {name}: {line}" for name, line in how.items() if line)
    print(text)
    print(how_text)
    loads = "; ".join(f"{name}: {row.get('load_before')} → {row.get('load_after')}" for name, row in rows.items())
    print(f"machine: {machine()}\ndate: {date}\nload averages (1/5/15 min) before → after: {loads}")
    if not args.no_write:
        command = " ".join(["python", "bench/serving_compare.py", *(argv if argv is not None else sys.argv[1:])])
        write_doc(args.out, text + "\n\nHow each system ran:\n" + how_text, date, loads, command)


def write_doc(doc: Path, text: str, date: str, loads: str, command: str) -> None:
    """Replace the measured block of the report (between the markers), keeping the notes."""
    begin, end = "<!-- measured: begin -->", "<!-- measured: end -->"
    block = (
        f"{begin}\nCommand: `{command}`  \nMachine: {machine()}  \nDate: {date}  \n"
        f"Load averages (1/5/15 min) before → after each system: {loads}\n\n{text}\n{end}"
    )
    current = doc.read_text() if doc.exists() else f"# pagemesh on CPU, side by side with its peers\n\n{begin}\n{end}\n"
    head, _, rest = current.partition(begin)
    _, _, tail = rest.partition(end)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(head + block + tail)


if __name__ == "__main__":
    main()
