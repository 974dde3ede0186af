"""Memory of a whole `pagemesh up` mesh under load: PSS of every process, and whether it loaded torch.

    python bench/mesh_memory.py [--streams 32] [--tokens 128] [--diffusion 0|1] [-- extra pagemesh up flags]

Starts `pagemesh up` (the default LLM topology: a prefill and a decode worker; `--diffusion 1`
adds the default image worker), runs `--streams` greedy completions of 128-token prompts at once
(`--tokens` each, `ignore_eos`), and samples each process's PSS (/proc/PID/smaps_rollup: its
private memory plus its share of what it shares, so the column adds up to the mesh's) every
0.2 s while they run. Prints, per process, the peak PSS and whether libtorch is mapped, then the
total of the peaks (an upper bound: the peaks need not coincide). PSS counts only pages touched:
a KV pool reserved but not yet written is not in it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import threading
import time

import openai

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME


def mesh_processes(launcher_pid: int) -> dict[int, str]:
    """pid -> role for the launcher and every process under it (by its `pagemesh` subcommand)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        pid, ppid, args = line.strip().split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = {launcher_pid: "launcher (pagemesh up)"}, [launcher_pid]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            words = args.split()
            role = next((w for w in words if w in ("gateway", "tokenizer", "scheduler", "worker", "diffusion")), "")
            if role == "worker" and "--worker-id" in words:
                role = words[words.index("--worker-id") + 1]
            found[pid] = role or words[-1]
            todo.append(pid)
    return found


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--diffusion", type=int, default=0)
    parser.add_argument("flags", nargs="*", help="more `pagemesh up` flags (after --)")
    args = parser.parse_args()
    launcher: list[subprocess.Popen] = []
    with running_mesh("--diffusion", str(args.diffusion), *args.flags, launcher=launcher) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
        prompt = " ".join(f"word{i}" for i in range(45))  # 127-128 tokens with the "i: " before it (64 words were 185)
        peaks: dict[int, int] = {}
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for pid in mesh_processes(launcher[0].pid):
                    peaks[pid] = max(peaks.get(pid, 0), pss_kb(pid))
                time.sleep(0.2)

        def one(i: int) -> int:
            r = client.completions.create(
                model=DEFAULT_MODEL_NAME,
                prompt=f"{i}: {prompt}",
                max_tokens=args.tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
            produced = sum(pool.map(one, range(args.streams)))
        elapsed = time.monotonic() - start
        done.set()
        sampler.join()
        roles = mesh_processes(launcher[0].pid)
        print(f"{args.streams} streams, {produced} tokens in {elapsed:.1f} s; load average {os.getloadavg()[0]:.2f}")
        print("\n| process | peak PSS (MB) | libtorch mapped |\n| --- | ---: | --- |")
        total = 0
        for pid, role in sorted(roles.items(), key=lambda x: x[1]):
            kb = peaks.get(pid, pss_kb(pid))
            total += kb
            print(f"| {role} | {kb / 1024:.0f} | {'yes' if maps_torch(pid) else 'no'} |")
        print(f"| **total** | **{total / 1024:.0f}** | |")


if __name__ == "__main__":
    main()
