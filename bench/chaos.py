"""Chaos soak: a supervised mesh under 1.5 times its capacity while processes are killed and
stopped at random; afterwards every request must have ended exactly once, and correctly.

    clients (threads) ──greedy requests, streamed or not, some abandoned; some images──▶ gateway
    fault driver ──SIGKILL, or SIGSTOP ... SIGCONT──▶ a random worker, a tokenizer, the scheduler
    supervisor (`pagemesh up`'s, services/supervisor.py) ──▶ starts each killed process again

The mesh is `pagemesh up`'s own (`launcher.Mesh`: start, then watch = restart what exits), run in
this process so that the driver can signal its children; loopback only. Every prompt's text is
first taken with no fault; under chaos each request ends in one of

    completed  the whole text, equal to the fault-free one   (or `wrong`: a different text)
    4xx / 5xx  an HTTP error, or a stream's error event (5xx)
    aborted    the client closed its stream early, on purpose
    hung       no end a minute past the gateway's --request-timeout (`wrong` and `hung` are lost)

and at the end every LLM worker must hold no KV page. The process exits 1 if anything was lost
or a page leaked. The mesh by default is the issue's: `--prefill 1 --decode 2 --diffusion 1
--tokenizers 2`, the default model as served by default with `--batch-invariant` (so a moved
greedy stream must equal its fault-free text), one fault every 30-60 s, and as many clients as
1.5 x the requests the decode workers run at once (`--max-num-seqs` each); before the faults, the
same clients run `--measure` seconds without any, which gives the mesh's capacity in requests/s.
Run:  python -m pagemesh.bench.chaos --duration 600 --json chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

import openai

from pagemesh.bench.local_mesh import LATE_S, free_port, metrics, per_worker, sample_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

PROMPTS = [
    "Count on and on:",
    "Tell me a story:",
    "The capital of France is",
    "List some colours:",
    "def fibonacci(n):",
    "Once upon a time",
]
OUTCOMES = ("completed", "wrong", "4xx", "5xx", "aborted", "hung")
LOST = ("wrong", "hung")
RETRY_AFTER_S = 1.0  # a client's pause after an error response
IMAGE_PROMPT = "a handwritten 3"
GATEWAY_TIMEOUT_ENV = "PAGEMESH_REQUEST_TIMEOUT"  # the gateway's --request-timeout


@dataclass(frozen=True)
class Job:
    prompt: str
    stream: bool
    abandon_after: int | None  # text chunks read before the client closes its stream
    image: bool = False  # an image request (the prompt is its text); the outcome alone counts


def request_text(client: openai.OpenAI, job: Job, max_tokens: int) -> tuple[str, str | None]:
    """Run one request; returns (its outcome, the text when it completed, or the error's code
    when it failed). An error after the stream finished would be a second ending: `wrong`."""
    request = dict(
        model=DEFAULT_MODEL_NAME,
        prompt=job.prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    finished = False
    try:
        if job.image:
            drawn = client.images.generate(prompt=job.prompt, size="8x8", extra_body={"seed": 3})
            return ("completed" if drawn.data and drawn.data[0].b64_json else "wrong"), None
        if not job.stream:
            done = client.completions.create(**request)
            return "completed", done.choices[0].text
        pieces: list[str] = []
        stream = client.completions.create(stream=True, **request)
        for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if finished and choice.text:
                return "wrong", None  # text after the end
            pieces.append(choice.text or "")
            finished = finished or choice.finish_reason is not None
            if job.abandon_after is not None and len(pieces) >= job.abandon_after and not finished:
                stream.close()
                return "aborted", None
        return "completed", "".join(pieces)
    except openai.APITimeoutError:
        return "hung", None
    except openai.APIStatusError as e:
        return ("4xx" if e.status_code < 500 else "5xx"), f"{e.status_code} {e.code}"
    except openai.APIConnectionError:
        return "hung", None  # the gateway is never signalled: a lost connection is a defect
    except openai.APIError as e:  # a stream's error event
        return ("wrong" if finished else "5xx"), f"event {e.code}"


class Tally:
    """Outcomes and what went wrong, from many threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()  # "503 worker_failure": n
        self.lost: list[str] = []

    def add(self, job: Job, outcome: str, said: str | None, expected: str) -> None:
        """`said`: what request_text returned with the outcome (the text, or the error's code)."""
        if outcome == "completed" and said != expected:
            outcome = "wrong"
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome in ("4xx", "5xx"):
                self.errors[str(said)] += 1
            if outcome in LOST:
                self.lost.append(f"{outcome}: {job} got {said!r}, expected {expected!r}")


class FaultDriver:
    """Every few seconds, one fault on one ready process: SIGKILL (the supervisor starts it
    again), or SIGSTOP for a while then SIGCONT (shorter or longer than the heartbeat timeout).
    One fault at a time, so the mesh keeps some capacity."""

    def __init__(self, mesh, targets: list[str], interval_s: float, max_stop_s: float, seed: int):
        self.mesh, self.targets = mesh, targets
        self.interval_s, self.max_stop_s = interval_s, max_stop_s
        self.random = random.Random(seed)
        self.kills: collections.Counter[str] = collections.Counter()
        self.stops: collections.Counter[str] = collections.Counter()
        self.stopped_now: list = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.random.uniform(2 / 3, 4 / 3) * self.interval_s):
            ready = [n for n in self.targets if n in self.mesh.supervisor.ready]
            if not ready:
                continue
            name = self.random.choice(ready)
            proc = self.mesh.children[name]
            if proc.poll() is not None:
                continue
            if self.random.random() < 0.5:
                proc.send_signal(signal.SIGKILL)
                self.kills[name] += 1
                print(f"chaos: SIGKILL {name}", file=sys.stderr, flush=True)
                continue
            pause = self.random.uniform(0.5, self.max_stop_s)
            print(f"chaos: SIGSTOP {name} for {pause:.1f}s", file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGSTOP)
            self.stopped_now.append(proc)
            self.stops[name] += 1
            self.done.wait(pause)
            self.resume_all()

    def resume_all(self) -> None:
        while self.stopped_now:
            proc = self.stopped_now.pop()
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)


class SupervisedMesh:
    """`pagemesh up`'s Mesh in a thread of its own: started, then watched (exited children are
    started again) until `stop()`. Its children's logs go to `log_path`."""

    def __init__(self, flags: list[str], log_path: str):
        from pagemesh.services import launcher
        from pagemesh.services.log_relay import LogRelay

        self.port = free_port()
        args = launcher.parse([*flags, "--port", str(self.port), "--ready-timeout", "900"])
        self.mesh = launcher.Mesh(args)
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.mesh.logs = self.mesh.supervisor.relay = LogRelay(self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.watching = None

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.mesh.start(), self.loop).result()
        self.watching = asyncio.run_coroutine_threadsafe(self.mesh.watch(), self.loop)

    def gave_up(self) -> str | None:
        """Why the supervisor stopped (a child kept dying at start), or None."""
        if self.watching is not None and self.watching.done() and not self.watching.cancelled():
            return repr(self.watching.exception())
        return None

    def stop(self) -> None:
        if self.watching is not None:
            self.watching.cancel()
            # a turn of the loop for the cancellation to reach the task (it closes its socket)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), self.loop).result(timeout=LATE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=LATE_S)
        self.mesh.stop()
        self.log.close()


def kv_settled(url: str, workers: set[str]) -> dict[str, float] | None:
    """Every LLM worker registered and holding no KV page (the sample), or None in time."""

    def usage() -> dict[str, float]:
        try:
            return per_worker(metrics(url), "pagemesh_kv_cache_usage_ratio")
        except OSError:
            return {}

    return sample_until(usage, lambda u: set(u) == workers and not any(u.values()), timeout=2 * LATE_S, interval=0.5)


def migrations_in(log_path: str) -> int:
    """Requests the tokenizer sent again after losing their worker (its log survives restarts
    of the scheduler, whose own count starts again at zero)."""
    with open(log_path, "rb") as f:
        return sum(1 for line in f if b"request migrating" in line and b"lost" in line)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagemesh.bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load under faults")
    parser.add_argument("--measure", type=float, default=60.0, help="seconds of the same load without faults first")
    parser.add_argument("--mixed", type=int, default=0)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--diffusion", type=int, default=1)
    parser.add_argument("--tokenizers", type=int, default=2)
    parser.add_argument("--image-share", type=float, default=0.1, help="share of requests that ask for an image")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per worker: capacity is this x decoding workers")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load", type=float, default=1.5, help="concurrent clients per unit of capacity")
    parser.add_argument("--fault-interval", type=float, default=45.0, help="mean seconds between faults (+-1/3)")
    parser.add_argument("--max-stop", type=float, default=10.0, help="longest SIGSTOP, seconds")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--targets", nargs="+", default=None, help="the processes faults may hit (default: all)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="the gateway's: it ends a request then")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve with --batch-invariant (--no-batch-invariant: the defaults)",
    )
    parser.add_argument("--log", default="/tmp/pagemesh-chaos.log", help="the mesh's logs")
    parser.add_argument("--json", default=None, help="write the counts here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    flags = ["--mixed", str(args.mixed), "--prefill", str(args.prefill), "--decode", str(args.decode)]
    flags += ["--diffusion", str(args.diffusion), "--tokenizers", str(args.tokenizers)]
    # batch-invariant: a request that moves to another tokenizer replica, or to a mixed worker, is
    # recomputed in one prefill, and only this mode makes that the same bits as the decode steps;
    # --no-batch-invariant: the defaults (a decode worker's loss resumes exactly without it)
    flags += ["--batch-invariant"] if args.batch_invariant else []
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--threads-per-worker", "1"]
    # small KV pools: the default takes GBs per worker, and an OOM kill is not a fault we chose
    flags += ["--num-pages", "256", "--max-model-len", "256", "--heartbeat-timeout", str(args.heartbeat_timeout)]
    # the gateway ends any request at its own timeout: one the client still waits for after that hung
    os.environ[GATEWAY_TIMEOUT_ENV] = str(args.request_timeout)
    mesh = SupervisedMesh(flags, args.log)
    started = time.monotonic()
    mesh.start()
    print(f"chaos: mesh up in {time.monotonic() - started:.0f}s: {sorted(mesh.mesh.children)}", file=sys.stderr)
    llm_workers = {n for n in mesh.mesh.children if n.startswith(("mixed-", "prefill-", "decode-"))}
    others = {n for n in mesh.mesh.children if n.startswith(("tokenizer", "diffusion"))} | {"scheduler"}
    targets = sorted(llm_workers | others) if args.targets is None else args.targets
    driver = FaultDriver(mesh.mesh, targets, args.fault_interval, args.max_stop, args.seed)
    try:
        capacity, tally, settled = soak(args, mesh, driver, llm_workers)
        gave_up = mesh.gave_up()
    finally:
        driver.done.set()
        driver.resume_all()
        restarts = mesh.mesh.supervisor.restarts
        mesh.stop()
    asked = sum(tally.outcomes.values()) - tally.outcomes["aborted"]  # abandoned by their clients on purpose
    counts = {
        "capacity_requests_per_s": capacity,
        "success_rate": round(tally.outcomes["completed"] / asked, 4) if asked else None,
        "requests": sum(tally.outcomes.values()),
        **{k: tally.outcomes[k] for k in OUTCOMES},
        "lost": sum(tally.outcomes[k] for k in LOST),
        "kills": sum(driver.kills.values()),
        "stops": sum(driver.stops.values()),
        "restarts": restarts,
        "migrations": migrations_in(args.log),
        "kv_pages_free_after": settled is not None,
        "errors": dict(tally.errors.most_common()),
        "clients": clients_for(args),
        "duration_s": args.duration,
    }
    print(json.dumps(counts, indent=1))
    print("kills by process:", dict(driver.kills), " stops by process:", dict(driver.stops))
    print("errors by code:", dict(tally.errors.most_common()))
    for line in tally.lost[:20]:
        print("LOST", line)
    if gave_up:
        print("the supervisor gave up:", gave_up)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=1)
    return 0 if counts["lost"] == 0 and settled is not None and not gave_up else 1


def clients_for(args: argparse.Namespace) -> int:
    """`--load` x the requests the decoding workers run at once."""
    return max(1, round(args.load * args.max_num_seqs * (args.mixed + args.decode)))


def soak(args: argparse.Namespace, mesh: SupervisedMesh, driver: FaultDriver, llm_workers: set[str]):
    """Fault-free texts first, then the clients for `--measure` s without faults (the mesh's
    capacity: requests completed per second); then the same clients and the faults for
    `--duration`; then every request in flight to its end (the faults stopped), and the KV pools
    settled. Returns (the capacity, the tally, the last KV sample or None)."""
    # the client waits past the gateway's timeout: a request the mesh did not end by then hung
    timeout = args.request_timeout + LATE_S
    client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    expected = {}
    for prompt in PROMPTS:  # no fault yet
        expected[prompt] = request_text(client, Job(prompt, False, None), args.max_tokens)[1]
    expected[IMAGE_PROMPT] = None
    clients = clients_for(args)
    rng, rng_lock = random.Random(args.seed), threading.Lock()

    def client_loop(tally: Tally, load_ends: float) -> None:
        while time.monotonic() < load_ends and mesh.gave_up() is None:
            with rng_lock:
                prompt, stream, abandon = rng.choice(PROMPTS), rng.random() < 0.7, rng.random() < 0.2
                job = Job(prompt, stream, rng.randint(1, args.max_tokens // 2) if stream and abandon else None)
                if rng.random() < args.image_share:
                    job = Job(IMAGE_PROMPT, False, None, image=True)
            outcome, text = request_text(client, job, args.max_tokens)
            tally.add(job, outcome, text, expected[job.prompt])
            if outcome in ("4xx", "5xx"):
                time.sleep(RETRY_AFTER_S)  # as a client told Retry-After would, not at once again

    def load(seconds: float) -> tuple[Tally, list[threading.Thread]]:
        tally, ends = Tally(), time.monotonic() + seconds
        threads = [threading.Thread(target=client_loop, args=(tally, ends), daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        return tally, threads

    measured, threads = load(args.measure)
    for t in threads:
        t.join()
    capacity = round(measured.outcomes["completed"] / args.measure, 3) if args.measure else None
    print(f"chaos: no faults, {clients} clients: {dict(measured.outcomes)} in {args.measure:.0f}s", file=sys.stderr)
    faults = threading.Thread(target=driver.run, daemon=True)
    faults.start()
    tally, threads = load(args.duration)
    driver.done.wait(args.duration)
    driver.done.set()  # no new fault: what is in flight ends on a mesh that comes back whole
    faults.join()
    driver.resume_all()
    for t in threads:
        t.join()  # each request ends by the client's timeout at the latest
    return capacity, tally, kv_settled(mesh.url, llm_workers)


if __name__ == "__main__":
    raise SystemExit(main())
