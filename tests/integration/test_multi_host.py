"""The mesh across three hosts: network namespaces on this machine joined by veth pairs on a
bridge, every process bound to its own host's address with `tcp://` addresses, so the prefill
worker's KV pages cross a real network interface to the decode worker.

    root namespace (the test, the client) ── bridge 10.213.N.254
       ├── veth ── host "gw"  10.213.N.1: scheduler :5557, tokenizer :5560/:5561, gateway :8000/:5570
       ├── veth ── host "pf"  10.213.N.2: prefill worker
       └── veth ── host "dc"  10.213.N.3: decode worker, KV endpoint :5600

The processes run the argv `pagemesh up` would give them (services.launcher.plan), with each
ipc:// address replaced by its host's tcp:// one. A greedy completion through this mesh equals the
same request through `pagemesh up` on one host, and the decode host's interface received at
least the KV bytes the decode worker reports. Skips where namespaces cannot be made (not root,
no `ip`, no permission: e.g. an unprivileged container).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, free_port, running_mesh, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME
from pagemesh.common.python_command import python_module

pytestmark = pytest.mark.slow

FLAGS = ("--prefill", "1", "--decode", "1", "--diffusion", "0", "--threads-per-worker", "1")
REQUEST = dict(model=DEFAULT_MODEL_NAME, prompt="The three primary colours are", max_tokens=24, temperature=0)
HOSTS = {"gw": 1, "pf": 2, "dc": 3}  # host -> last byte of its address
WHERE = {"scheduler": "gw", "tokenizer": "gw", "gateway": "gw", "prefill-0": "pf", "decode-0": "dc"}
PORTS = {"scheduler": ("gw", 5557), "tokenizer": ("gw", 5560), "tokenizer-out": ("gw", 5561)}
PORTS |= {"gateway-0": ("gw", 5570), "kv-decode-0": ("dc", 5600)}


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


class Network:
    """Three namespaces on one bridge; names carry this process's id so runs do not collide."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.subnet = f"10.213.{tag % 250}"
        self.bridge = f"pmbr{tag}"
        self.ns = {host: f"pm{tag}-{host}" for host in HOSTS}
        self.made: list[tuple[str, str]] = []

    def address(self, host: str) -> str:
        return f"{self.subnet}.{HOSTS[host]}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        # a host firewall may filter bridged traffic (br_netfilter with an iptables FORWARD policy
        # of DROP, as a running Docker engine sets it): let through what crosses this bridge only
        if shutil.which("iptables"):
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
                self.made.append(("iptables", " ".join(rule)))
        for host, ns in self.ns.items():
            _ip("netns", "add", ns)
            self.made.append(("netns", ns))
            outside, inside = f"pm{os.getpid() % 10000}{host}", "eth0"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
            self.made.append(("link", outside))
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def rx_bytes(self, host: str) -> int:
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns[host], "cat", "/sys/class/net/eth0/statistics/rx_bytes"],
            check=True,
            capture_output=True,
            text=True,
        )
        return int(out.stdout)

    def connected(self) -> bool:
        """The other hosts reach a TCP listener on the gateway host. Traffic between namespaces
        crosses the bridge, which a host firewall may still filter (`up` lets this bridge's
        traffic through iptables where it can): then the mesh could never start."""
        listen = "import socket,sys; s=socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)"
        listen += "; s.settimeout(60); [s.accept() for _ in range(2)]"
        connect = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)"
        run = ["ip", "netns", "exec"]
        server = subprocess.Popen(
            [*run, self.ns["gw"], sys.executable, "-c", listen, self.address("gw")], stdout=subprocess.PIPE, text=True
        )
        try:
            port = server.stdout.readline().strip()
            for host in ("pf", "dc"):
                argv = [*run, self.ns[host], sys.executable, "-c", connect, self.address("gw"), port]
                if subprocess.run(argv, capture_output=True, timeout=120).returncode != 0:
                    return False
            return server.wait(timeout=120) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()

    def down(self) -> None:
        for kind, name in reversed(self.made):  # a namespace's end of a veth pair goes with it
            if kind == "iptables":
                subprocess.run(["iptables", "-D", *name.split()], capture_output=True)
                continue
            args = ["link", "del", name] if kind == "link" else ["netns", "del", name]
            subprocess.run(["ip", *args], capture_output=True)


@pytest.fixture(scope="module")
def network():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    net = Network()
    try:
        net.up()
    except subprocess.CalledProcessError as e:
        net.down()
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    if not net.connected():
        net.down()
        pytest.skip("namespaces on a bridge cannot reach each other here (a firewall filters bridged traffic)")
    try:
        yield net
    finally:
        net.down()


def host_argv(argv: list[str], net: Network, port: int) -> list[str]:
    """A process's `pagemesh up` argv with tcp:// addresses on the hosts and no launcher socket."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--ready-address":
            next(it)
            continue
        if arg.startswith("ipc://"):
            host, host_port = PORTS[Path(arg).name]
            arg = f"tcp://{net.address(host)}:{host_port}"
        out.append(arg)
    if out[0] == "gateway":
        out[out.index("--host") + 1] = net.address("gw")
        out[out.index("--port") + 1] = str(port)
    return out


@contextmanager
def mesh_across(net: Network, run_dir: str):
    """Starts every process in its host's namespace; yields the gateway's URL once /ready."""
    from pagemesh.services import launcher

    port = free_port()
    children: dict[str, subprocess.Popen] = {}
    url = f"http://{net.address('gw')}:{port}"
    try:
        for name, argv in launcher.plan(launcher.parse(list(FLAGS)), run_dir):
            cmd = ["ip", "netns", "exec", net.ns[WHERE[name]], *python_module("pagemesh.services.cli")]
            children[name] = subprocess.Popen([*cmd, *host_argv(argv, net, port)])

        def ready() -> bool:
            dead = {n: p.returncode for n, p in children.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"processes exited: {dead}")
            try:
                return urllib.request.urlopen(url + "/ready", timeout=HANG_S).status == 200
            except OSError:
                return False

        assert wait_until(ready, interval=0.5), "the mesh across hosts never became ready"
        yield url
    finally:
        for p in children.values():
            p.terminate()
        for p in children.values():
            try:
                p.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def single_host_text():
    with running_mesh(*FLAGS) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        return client.completions.create(**REQUEST).choices[0].text


def test_a_completion_across_hosts_equals_the_single_host_one(network, single_host_text, tmp_path):
    with mesh_across(network, str(tmp_path)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        rx_before = network.rx_bytes("dc")
        r = client.completions.create(**REQUEST)
        assert r.choices[0].text == single_host_text and r.usage.completion_tokens == REQUEST["max_tokens"]

        def decode_worker() -> dict:
            doc = json.loads(urllib.request.urlopen(url + "/status", timeout=HANG_S).read())
            return {w["id"]: w for w in doc["workers"]}["decode-0"]

        # the decode worker's next heartbeats report the pages it took in and the tokens it made
        # (one heartbeat may carry the pages before the tokens: its load snapshot is taken
        # between steps, CI once read it there)
        decode = sample_until(decode_worker, lambda w: w["kv"]["bytes_received"] > 0 and w["produced"] > 0)
        assert decode is not None, "the decode worker never reported the pages it took in and decoded"
        received = decode["kv"]["bytes_received"]
        # ...and they came in over the decode host's interface (with the tokens it was sent and
        # its heartbeats' replies), not over a socket that never left a host
        assert network.rx_bytes("dc") - rx_before >= received
