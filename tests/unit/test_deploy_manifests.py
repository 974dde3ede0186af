"""deploy/k8s and compose.yaml, checked offline: the Kubernetes objects against the Kubernetes
JSON schemas that `kubernetes-validate` bundles (strict: an unknown field is an error), compose.yaml
against the compose-spec schema that `check-jsonschema` bundles (and `docker compose config` where
the plugin is installed), and the manifests against the mesh itself: every process kind of
`pagemesh up` has a Deployment whose arguments parse with that process's own flags, the Services
select those pods on the ports the processes bind, and the worker pools scale."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pagemesh.services.launcher import parse, plan

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest release we claim; strict schemas of later ones agree
POD = {"POD_IP": "10.1.2.3", "POD_NAME": "pagemesh-decode-7d9f-x2x4"}
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())
OBJECTS = [doc for f in KUSTOMIZATION["resources"] for doc in yaml.safe_load_all((K8S / f).read_text()) if doc]
DEPLOYMENTS = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Deployment"}
SERVICES = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Service"}
POOLS = ("pagemesh-prefill", "pagemesh-decode", "pagemesh-diffusion")


def container(name: str) -> dict:
    [c] = DEPLOYMENTS[name]["spec"]["template"]["spec"]["containers"]
    return c


def argv_of(name: str) -> list[str]:
    """The pagemesh argv a Deployment runs, with Kubernetes' $(VAR) filled in as in a pod."""
    args = container(name)["args"]
    for var, value in POD.items():
        args = [a.replace(f"$({var})", value) for a in args]
    assert args[0] == "pagemesh"
    return args[1:]


def kind_of(argv: list[str]) -> str:
    return f"worker:{argv[argv.index('--role') + 1]}" if argv[0] == "worker" else argv[0]


def test_every_object_validates_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    assert OBJECTS
    for obj in OBJECTS:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises on any error
    broken = {**DEPLOYMENTS["pagemesh-decode"], "spec": {**DEPLOYMENTS["pagemesh-decode"]["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail: a misspelt field
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest_in_the_folder():
    assert sorted(KUSTOMIZATION["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_deployments_are_the_process_kinds_of_pagemesh_up_in_the_compose_image():
    launched = {kind_of(argv) for _, argv in plan(parse([]), "/tmp/pm")}
    deployed = {kind_of(argv_of(name)) for name in DEPLOYMENTS}
    assert deployed == launched
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    image = compose["x-pagemesh"]["image"]
    assert {container(name)["image"] for name in DEPLOYMENTS} == {image}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_deployment_parses_with_its_process_flags_and_binds_on_its_pod(name, monkeypatch):
    c = container(name)
    env = {e["name"]: e for e in c.get("env", [])}
    for var in POD:  # what the arguments use comes from the downward API
        if any(f"$({var})" in a for a in c["args"]):
            field = {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"}[var]
            assert env[var]["valueFrom"]["fieldRef"]["fieldPath"] == field
    for key, e in env.items():
        if "value" in e:
            monkeypatch.setenv(key, e["value"])
    argv = argv_of(name)
    scheduler = "tcp://pagemesh-scheduler:5557"
    if argv[0] == "scheduler":
        from pagemesh.services.scheduler.main import parse as parse_scheduler

        bound = [parse_scheduler(argv[1:]).address]
    elif argv[0] == "tokenizer":
        from pagemesh.services.tokenizer.config import parse_args

        cfg = parse_args(argv[1:])
        assert cfg.scheduler_address == scheduler and cfg.name == POD["POD_NAME"]
        bound = [cfg.address, cfg.output_address]
    elif argv[0] == "gateway":
        from pagemesh.gateway.config import parse_args

        cfg = parse_args(argv[1:])
        assert (cfg.scheduler_address, cfg.tokenizer_address) == (scheduler, "tcp://pagemesh-tokenizer:5560")
        assert cfg.port == 8000 and cfg.host == "0.0.0.0"
        bound = [cfg.reply_address]
    elif argv[0] == "diffusion":
        from pagemesh.workers.diffusion.config import parse_diffusion

        cfg = parse_diffusion(argv[1:])
        assert cfg.shell.scheduler_address == scheduler and cfg.shell.worker_id == POD["POD_NAME"]
        bound = []
    else:
        from pagemesh.workers.llm.main import parse as parse_worker

        cfg = parse_worker(argv[1:])
        assert cfg.shell.scheduler_address == scheduler
        assert cfg.shell.worker_id == POD["POD_NAME"]  # one id per pod: the pool scales
        bound = [cfg.kv_address] if cfg.kv_address else []
        assert cfg.kv_advertise == cfg.kv_address
    for address in bound:  # each ZMQ bind is on the pod's own address, on a declared port
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        assert host == POD["POD_IP"], address
        assert int(port) in {p["containerPort"] for p in c["ports"]}


def test_services_select_their_pods_on_the_ports_the_processes_use():
    for service in SERVICES.values():
        selector = service["spec"]["selector"]
        [target] = [
            d for d in DEPLOYMENTS.values() if d["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
        ]
        assert target["spec"]["selector"]["matchLabels"] == selector
        ports = {p["name"]: p["containerPort"] for p in container(target["metadata"]["name"])["ports"]}
        for port in service["spec"]["ports"]:
            t = port["targetPort"]
            assert (ports[t] if isinstance(t, str) else t) in ports.values()
    # the ZMQ names resolve straight to the pods (headless), the HTTP one load-balances
    assert SERVICES["pagemesh-scheduler"]["spec"]["clusterIP"] == "None"
    assert SERVICES["pagemesh-tokenizer"]["spec"]["clusterIP"] == "None"
    assert SERVICES["pagemesh-gateway"]["spec"]["type"] == "ClusterIP"


def test_the_gateway_is_ready_on_ready_and_the_pools_scale():
    probe = container("pagemesh-gateway")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/ready" and probe["port"] == "http"
    assert {
        d["spec"]["strategy"]["type"]
        for n, d in DEPLOYMENTS.items()
        if n in ("pagemesh-scheduler", "pagemesh-tokenizer")
    } == {"Recreate"}
    for name in POOLS:  # nothing but the replica count says how many: `kubectl scale` is enough
        assert DEPLOYMENTS[name]["spec"]["replicas"] == 1
        assert "$(POD_NAME)" in container(name)["args"]


def check_compose(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema with its bundled compose-spec schema (no network)."""
    tool = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(tool).exists():
        pytest.skip("check-jsonschema is not installed (the dev extra has it)")
    return subprocess.run(
        [tool, "--builtin-schema", "vendor.compose-spec", str(path)], capture_output=True, text=True, timeout=300
    )


def test_compose_validates_against_the_compose_spec():
    result = check_compose(ROOT / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_check_fails_on_a_broken_file(tmp_path):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    compose["services"]["gateway"]["portz"] = compose["services"]["gateway"].pop("ports")  # a misspelt key
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(compose))
    result = check_compose(tmp_path / "compose.yaml")
    assert result.returncode != 0 and "portz" in result.stdout + result.stderr


def compose_commands() -> list[list[str]]:
    """Compose v2 (`docker compose`) and Debian's docker-compose 1.29, those installed here."""
    found = []
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        found.append([docker, "compose"])
    if shutil.which("docker-compose"):
        found.append([shutil.which("docker-compose")])
    return found


def test_docker_compose_config_accepts_compose_yaml():
    """Both file sets, with every compose installed here (compose.yaml must work with v2 and 1.29)."""
    commands = compose_commands()
    if not commands:
        pytest.skip("neither `docker compose` nor docker-compose here (the compose-spec schema check above still runs)")
    for command in commands:
        for files in (["compose.yaml"], ["compose.yaml", "compose.zmq-keys.yaml"]):
            argv = [*command, *(a for f in files for a in ("-f", str(ROOT / f))), "config", "--quiet"]
            result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
            assert result.returncode == 0, (argv, result.stderr)


def test_the_zmq_keys_override_gives_every_compose_service_the_keys_folder():
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())
    override = yaml.safe_load((ROOT / "compose.zmq-keys.yaml").read_text())
    assert set(override["services"]) == set(base["services"])
    for name, service in override["services"].items():
        folder = service["environment"]["PAGEMESH_ZMQ_KEYS"]
        assert [v.rsplit(":", 2)[1:] for v in service["volumes"]] == [[folder, "ro"]], name
    result = check_compose(ROOT / "compose.zmq-keys.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def json_patch_add(doc: dict, ops: list[dict]) -> dict:
    """The `add` operations of a JSON patch (RFC 6902), applied to a copy: what kustomize does
    with the zmq-keys component's patch (it has no other op)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add"
        *parents, last = op["path"].strip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.append(op["value"]) if last == "-" else node.insert(int(last), op["value"])
        else:
            node[last] = op["value"]
    return doc


def test_the_zmq_keys_component_mounts_the_secret_into_every_deployment():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    component = yaml.safe_load((K8S / "zmq-keys" / "kustomization.yaml").read_text())
    (patch,) = component["patches"]
    assert patch["target"] == {"kind": "Deployment"}
    for name, deployment in DEPLOYMENTS.items():
        keyed = json_patch_add(deployment, yaml.safe_load(patch["patch"]))
        kubernetes_validate.validate(keyed, KUBERNETES_VERSION, strict=True)
        pod = keyed["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (mount,) = container["volumeMounts"]
        assert {"name": "PAGEMESH_ZMQ_KEYS", "value": mount["mountPath"]} in container["env"], name
        assert pod["volumes"] == [
            {"name": mount["name"], "secret": {"secretName": "pagemesh-zmq-keys", "defaultMode": 0o400}}
        ]


def test_the_scheduler_serves_what_compose_and_pagemesh_up_serve():
    """The gateway's readinessProbe (/ready) waits for every kind the scheduler serves."""
    env = {e["name"]: e.get("value") for e in container("pagemesh-scheduler")["env"]}
    [scheduler] = [argv for _, argv in plan(parse([]), "/tmp/pm") if argv[0] == "scheduler"]
    assert env["PAGEMESH_SERVES"] == scheduler[scheduler.index("--serves") + 1] == "llm,diffusion"


def test_an_image_override_renders_and_validates():
    """kustomize's `images:` (here to a registry's tagged image) applied to every Deployment: the
    rendered objects still validate."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    [entry] = KUSTOMIZATION["images"]
    override = {"name": entry["name"], "newName": "registry.example:5000/pagemesh", "newTag": "0.1.0"}
    rendered = copy.deepcopy(DEPLOYMENTS)
    for deployment in rendered.values():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            name, _, _tag = c["image"].partition(":")
            if name == override["name"]:
                c["image"] = f"{override['newName']}:{override['newTag']}"
    assert {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in rendered.values()} == {
        "registry.example:5000/pagemesh:0.1.0"
    }
    for deployment in rendered.values():
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
