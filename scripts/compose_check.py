"""The traffic half of scripts/compose_check.sh, against a compose mesh it started (2 decode workers).

Through the published port (127.0.0.1 only), with the official `openai` client:
  1. a chat completion and a PNG image;
  2. both decode workers serve: rounds of concurrent completions, each prompt its own, until each
     decode worker's own count of finished requests (`requests_finished` in the gateway's
     /status, which the scheduler has from the workers' heartbeats) went up, and its count of
     tokens produced with it;
  3. a long streaming chat (ignore_eos, max_tokens fixed) loses the decode container that holds it
     (the decode worker whose `running` is 1 and whose `produced` grows: worker id
     `decode-<hostname>`, compose's command), twice: first `docker kill` (Docker's restart policy
     leaves a killed container stopped, so the other decode worker must finish the stream; then
     compose starts it again), then a crash (SIGKILL to its process from the host; the restart
     policy brings it back). Each time the stream ends with every token asked for (usage,
     finish_reason `length`), the scheduler counts one more migration, and the container's worker
     registers again.
Only docker (inspect, ps, kill), compose (up) and HTTP to 127.0.0.1 are used. Exit 0: all held; else an AssertionError.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[compose_check.py {time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def get(base: str, path: str) -> bytes:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return r.read()


def status(base: str) -> dict:
    return json.loads(get(base, "/status"))


def decode_workers(base: str) -> dict[str, dict]:
    return {w["id"]: w for w in status(base)["workers"] if w["pool"] == "decode"}


def metric(base: str, name: str) -> float:
    """A sample of the gateway's /metrics without labels (0 if absent)."""
    for line in get(base, "/metrics").decode().splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{\}})? (\S+)$", line)
        if m:
            return float(m.group(1))
    return 0.0


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout.strip()


def containers(project: str, service: str) -> dict[str, str]:
    """worker id (`<service>-<hostname>`, as compose.yaml's commands name them) -> container id."""
    ids = docker(
        "ps",
        "-q",
        "--no-trunc",
        "--filter",
        f"label=com.docker.compose.project={project}",
        "--filter",
        f"label=com.docker.compose.service={service}",
    ).split()
    return {f"{service}-{docker('inspect', '-f', '{{.Config.Hostname}}', c)}": c for c in ids}


def inspect(container: str, fmt: str) -> str:
    return docker("inspect", "-f", fmt, container)


def wait_for(what: str, until, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = until()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(every)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--project", required=True, help="the compose project name")
    p.add_argument("--stream-tokens", type=int, default=400, help="max_tokens of the stream that loses its worker")
    p.add_argument("--kill-after", type=int, default=40, help="stream chunks received before the crash")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take")
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds one request may go without an answer")
    p.add_argument("--compose", type=shlex.split, required=True, help="the compose command with -p and -f")
    args = p.parse_args()
    base = args.base_url.rstrip("/")
    assert re.match(r"^http://127\.0\.0\.1:\d+$", base), "traffic goes to 127.0.0.1 only"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout)

    # ---- 1. a chat completion and an image ------------------------------------------------
    models = [m.id for m in client.models.list().data]
    log(f"models: {models}")
    llm = next(m for m in models if "digit" not in m)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    t = time.monotonic()
    # two at once: placed together, before any worker holds a page of the chat template's prefix,
    # they go one to each decode worker (by load), which then both hold that prefix (step 3)
    with ThreadPoolExecutor(2) as pool:
        chats = list(
            pool.map(lambda _: client.chat.completions.create(model=llm, messages=question, max_tokens=24), range(2))
        )
    for chat in chats:
        text = chat.choices[0].message.content
        log(f"chat completion in {time.monotonic() - t:.1f}s: {text!r} ({chat.usage.completion_tokens} tokens)")
        assert text.strip() and chat.usage.completion_tokens > 0
    t = time.monotonic()
    image = client.images.generate(prompt="a handwritten 7", n=1)
    png = base64.b64decode(image.data[0].b64_json)
    log(f"image in {time.monotonic() - t:.1f}s: {len(png)} bytes of PNG, size {getattr(image, 'size', '?')}")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    # ---- 2. both decode workers serve -------------------------------------------------------
    decode = containers(args.project, "decode")
    log(f"decode containers: {decode}")
    assert len(decode) == 2, decode
    workers = wait_for(
        "both decode workers registered", lambda: len(decode_workers(base)) == 2 and decode_workers(base), args.timeout
    )
    assert set(workers) == set(decode), (set(workers), set(decode))
    time.sleep(1.0)  # a heartbeat or two: the scheduler's counts catch up
    workers = decode_workers(base)
    finished = {w: s["requests_finished"] for w, s in workers.items()}
    log(f"finished requests per decode worker after the two chats: {finished}")
    before = {w: (s["requests_finished"], s["produced"]) for w, s in workers.items()}
    # plain completions, each prompt its own from its first token: no worker holds a page of any, so
    # the prefix placement has nothing to prefer and places by load (chats all share the chat
    # template's system prompt, and stay with the decode worker that cached it, by design)
    words = ["Seven", "Blue", "Rivers", "Quietly", "Under", "Mountains", "Every", "Winter"]
    for batch in range(1, 6):
        prompts = [f"{w} {batch}: a story about the number {i}." for i, w in enumerate(words)]
        t = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once; a failed request raises here
            done = list(pool.map(lambda q: client.completions.create(model=llm, prompt=q, max_tokens=16), prompts))
        assert all(c.usage.completion_tokens > 0 for c in done)
        time.sleep(1.0)  # a heartbeat or two: the scheduler's counts catch up
        now = decode_workers(base)
        served = {w: (now[w]["requests_finished"] - before[w][0], now[w]["produced"] - before[w][1]) for w in before}
        log(
            f"batch {batch}: {len(words)} concurrent completions in {time.monotonic() - t:.1f}s; "
            f"per decode worker (requests finished, tokens produced) since: {served}"
        )
        if all(r > 0 and n > 0 for r, n in served.values()):
            break
    else:
        raise AssertionError(f"a decode worker served nothing: {served}")

    # ---- 3. a stream outlives its decode container: `docker kill`, then a crash -----------------
    stream_outlives_its_decode_container(client, llm, base, decode, args, "docker kill")
    stream_outlives_its_decode_container(client, llm, base, decode, args, "crash")
    assert json.loads(get(base, "/ready")).get("ready") is True
    log("all checks passed")


# a prompt per fault, so the second stream's text differs from the first's: suffix speculation over
# this server's earlier outputs would otherwise race through it before a heartbeat reports it
PROMPTS = {
    "docker kill": "Count from one upwards in words, without stopping.",
    "crash": "Name the days of the week over and over, without stopping.",
}


def stream_outlives_its_decode_container(client, llm: str, base: str, decode: dict, args, how: str) -> None:
    """A long stream; the decode container that holds it goes, `how`:
    - "docker kill": Docker counts it as a manual stop and its restart policy leaves it stopped,
      so the other decode worker must finish the stream; then compose starts it again
      (`up -d --no-recreate`), as an operator would.
    - "crash": SIGKILL to its process from the host; the restart policy (`unless-stopped`)
      brings it back by itself. The stream finishes on whichever decode worker the scheduler
      places it (the crashed one's new process registers again within seconds, under its id).
    Either way: every token asked for, one more migration, the container back and its worker
    registered again."""
    migrations0 = metric(base, "pagemesh_request_migrations_total")
    workers = decode_workers(base)
    produced0 = {w: s["produced"] for w, s in workers.items()}
    chunks: list[str] = []
    result: dict = {}

    def stream() -> None:
        try:
            s = client.chat.completions.create(
                model=llm,
                messages=[{"role": "user", "content": PROMPTS[how]}],
                max_tokens=args.stream_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in s:
                if chunk.choices:
                    if chunk.choices[0].delta.content:
                        chunks.append(chunk.choices[0].delta.content)
                    if chunk.choices[0].finish_reason:
                        result["finish_reason"] = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    result["usage"] = chunk.usage
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            result["error"] = repr(e)

    t_stream = time.monotonic()
    th = threading.Thread(target=stream)
    th.start()
    wait_for(
        f"{args.kill_after} chunks of the stream",
        lambda: len(chunks) >= args.kill_after or not th.is_alive(),
        args.timeout,
        every=0.05,
    )
    assert th.is_alive(), f"the stream ended before its worker went: {result}"

    def holders() -> list[str]:
        """The decode workers the scheduler's /status shows running the stream (from heartbeats:
        a fast stream can have its first chunks out before one reports it)."""
        return [w for w, s in decode_workers(base).items() if s["running"] > 0 and s["produced"] > produced0[w]]

    held = wait_for("a decode worker reporting the stream", lambda: holders() or not th.is_alive(), 30.0, every=0.05)
    assert th.is_alive(), f"the stream ended before its worker went: {result}"
    assert held is not True and len(held) == 1, f"which decode worker holds the stream? {decode_workers(base)}"
    workers = decode_workers(base)
    [victim] = held
    [survivor] = [w for w in workers if w != victim]
    container = decode[victim]
    restarts0 = int(inspect(container, "{{.RestartCount}}"))
    pid = int(inspect(container, "{{.State.Pid}}"))
    chunks_at_kill = len(chunks)
    produced_at_kill = {w: s["produced"] for w, s in workers.items()}
    if how == "docker kill":
        log(f"stream: {chunks_at_kill} chunks so far, held by {victim}: docker kill {container[:12]}")
        docker("kill", container)
    else:
        log(f"stream: {chunks_at_kill} chunks so far, held by {victim} (container {container[:12]}): SIGKILL to {pid}")
        os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    th.join(args.timeout)
    assert not th.is_alive(), "the stream did not end"
    log(
        f"stream ended {time.monotonic() - t_kill:.1f}s after the {how} ({time.monotonic() - t_stream:.1f}s in all): "
        f"{len(chunks)} chunks, finish_reason {result.get('finish_reason')}, usage {result.get('usage')}"
    )
    assert "error" not in result, result["error"]
    assert result.get("finish_reason") == "length", result
    assert result["usage"].completion_tokens == args.stream_tokens, result["usage"]
    migrations = metric(base, "pagemesh_request_migrations_total")
    log(f"request migrations counted by the scheduler: {migrations0:.0f} -> {migrations:.0f}")
    assert migrations >= migrations0 + 1, "the scheduler counted no migration"

    if how == "docker kill":
        assert inspect(container, "{{.State.Running}}") == "false", "a killed container restarted by itself"
        by_survivor = decode_workers(base)[survivor]["produced"] - produced_at_kill[survivor]
        log(f"{container[:12]} stays stopped; the rest of the stream came from {survivor}: {by_survivor} tokens")
        assert by_survivor > 0, "the other decode worker did not take the stream over"
        subprocess.run([*args.compose, "up", "-d", "--no-recreate", "--no-build", "--scale", "decode=2"], check=True)
        wait_for(
            f"container {container[:12]} started again",
            lambda: inspect(container, "{{.State.Running}}") == "true",
            args.timeout,
        )
        log(f"compose started {container[:12]} again (process {pid} -> {inspect(container, '{{.State.Pid}}')})")
    else:
        wait_for(
            f"container {container[:12]} restarted",
            lambda: (
                int(inspect(container, "{{.RestartCount}}")) > restarts0
                and inspect(container, "{{.State.Running}}") == "true"
            ),
            args.timeout,
        )
        log(
            f"container {container[:12]} restarted by its restart policy "
            f"(RestartCount {restarts0} -> {inspect(container, '{{.RestartCount}}')}, process {pid} -> "
            f"{inspect(container, '{{.State.Pid}}')})"
        )
    time.sleep(max(0.0, 6.0 - (time.monotonic() - t_kill)))  # past the heartbeat timeout: the dead one is lost
    back = wait_for(
        f"{victim} registered again",
        lambda: (w := decode_workers(base).get(victim)) is not None and w["state"] != "lost" and w,
        args.timeout,
    )
    log(f"{victim} is back: state {back['state']}, requests_finished {back['requests_finished']}")
    if how == "crash":
        # the new process counts from 0: what it produced came after the crash
        after = decode_workers(base)
        log(
            f"the rest of the stream (it had {chunks_at_kill} chunks at the crash) came from: {survivor} "
            f"{after[survivor]['produced'] - produced_at_kill[survivor]} tokens, {victim}'s new process "
            f"{after[victim]['produced']} tokens"
        )


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        log(f"FAILED: {e}")
        sys.exit(1)
