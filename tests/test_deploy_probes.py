"""Issue 63, items 1-4: deploy/ as the KubeRay operator, the kubelet and the scheduler would run it.

The first tests read both rendered overlays: every probe of the RayService head asks for what
exists before Serve is deployed (KubeRay deploys serveConfigV2 only once the head is Ready),
liveness never waits on another service, the public Service carries the gRPC and the HTTP API,
no disruption budget blocks a node drain, nothing an autoscaler owns sets `replicas`, and the gpu
overlay places its pods on GPU nodes and spreads the targets.

The last two rehearse with the real processes: the head's command, environment and probes as
KubeRay writes them into the pod (tools/kuberay.py), run here, probed before Serve exists, then
Serve deployed as the operator deploys it; and a draft replica probed while it drains.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_deploy import config, containers, pod_templates, render

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import kuberay  # noqa: E402  (tools/ is not a package)

GPU = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"  # what the NVIDIA GPU Operator labels its GPU nodes with


@pytest.fixture(scope="module", params=["dev", "gpu"])
def objects(request):
    return request.param, render(request.param)


def rayservice(objs) -> dict:
    return next(o for o in objs if o["kind"] == "RayService")


def serve_ports(service: dict) -> dict[str, int]:
    """The ports that open only once KubeRay has deployed serveConfigV2: Serve's proxies."""
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    http = serve_config.get("http_options", {}).get("port", kuberay.DEFAULT_SERVE_PORT)
    return {"grpc": serve_config["grpc_options"]["port"], "http": http}


def ray_ports(params: dict[str, str]) -> dict[str, int]:
    """The ports `ray start --head` opens (with these parameters) before anything is deployed."""
    return {
        "gcs": int(params.get("port", kuberay.DEFAULT_GCS_PORT)),
        "dashboard": int(params.get("dashboard-port", kuberay.DEFAULT_DASHBOARD_PORT)),
        "agent": int(params["dashboard-agent-listen-port"]),
        "client": int(params.get("ray-client-server-port", 10001)),
        "metrics-export": int(params["metrics-export-port"]),
    }


def handler_port(spec: dict, container: dict) -> int:
    handler = next(spec[h] for h in ("httpGet", "grpc", "tcpSocket") if h in spec)
    return kuberay.probe_port(handler, container)


def test_the_heads_probes_ask_only_for_what_runs_before_serve(objects):
    """The probe deadlock: a head probed on Serve's ports never becomes Ready, so KubeRay never
    deploys Serve, so the ports never open. Every probe the head's Ray container runs (its own,
    and KubeRay's injected defaults where it writes none) is on a port `ray start` opens."""
    _, objs = objects
    service = rayservice(objs)
    container = kuberay.ray_container(service)
    before = ray_ports(kuberay.head_start_params(service))
    after = serve_ports(service)
    probes = kuberay.head_probes(service)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(probes)
    for kind, spec in probes.items():
        if "exec" in spec:
            continue  # KubeRay's own wget of Ray's health (Ray < 2.53)
        port = handler_port(spec, container)
        assert port not in after.values(), f"the head's {kind} asks Serve's port {port}: it opens only after Ready"
        assert port in before.values(), f"the head's {kind} asks port {port}, which `ray start` does not open"
    # Serve's ports are the container's, named as KubeRay looks for them (the proxy check and
    # <name>-serve-svc use "serve" and "serve-*")
    named = {p["containerPort"]: p["name"] for p in container["ports"]}
    assert named[after["http"]] == kuberay.SERVE_PORT_NAME
    assert named[after["grpc"]].startswith(kuberay.SERVE_PORT_NAME + "-")


def test_liveness_asks_the_process_alone(objects):
    """Liveness restarts a container: it may depend on nothing but the process. The draft and
    target answer a liveness service of their own on the health port (the process and its model
    loop) beside readiness (able to take sessions now); the head's liveness is Ray's own health."""
    from specdec.runtime.grpc_server import LIVENESS_SERVICE

    _, objs = objects
    for owner, template in pod_templates(objs):
        for c in containers(template, init=False):
            if c.get("args", [""])[0] not in ("draft", "target"):
                continue
            live, ready, startup = (c[p]["grpc"] for p in ("livenessProbe", "readinessProbe", "startupProbe"))
            assert live.get("service") == LIVENESS_SERVICE, (owner, live)
            assert ready.get("service", "") != LIVENESS_SERVICE, (owner, ready)  # "": able to serve
            assert startup.get("service") == LIVENESS_SERVICE, (owner, startup)  # the process is up
            assert live["port"] == ready["port"] == startup["port"]
    service = rayservice(objs)
    live = kuberay.head_probes(service)["livenessProbe"]
    assert handler_port(live, kuberay.ray_container(service)) not in serve_ports(service).values()


def test_the_public_service_carries_grpc_and_the_openai_http_api(objects):
    """Item 2: the Service clients use reaches both of Serve's proxies, and only on a head whose
    Serve KubeRay has found healthy (its ray.io/serve label), never before Serve is deployed."""
    _, objs = objects
    service = rayservice(objs)
    container = kuberay.ray_container(service)
    public = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "specdec-coordinator")
    targets = {p["name"]: kuberay.probe_port({"port": p["targetPort"]}, container) for p in public["spec"]["ports"]}
    assert set(targets.values()) == set(serve_ports(service).values())
    assert targets["grpc"] == serve_ports(service)["grpc"] and targets["http"] == serve_ports(service)["http"]
    assert public["spec"]["selector"].get(kuberay.SERVE_LABEL) == "true"


def workloads(objs) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "RayService")]


def template_labels(obj: dict) -> dict:
    if obj["kind"] == "RayService":
        return obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    return obj["spec"]["template"]["metadata"]["labels"]


def autoscaler_bounds(objs, obj: dict) -> tuple[int, int] | None:
    """(min, max) replicas of the HPA or KEDA ScaledObject that scales ``obj``, if one does."""
    for scaler in objs:
        ref = scaler.get("spec", {}).get("scaleTargetRef", {})
        if ref.get("kind") != obj["kind"] or ref.get("name") != obj["metadata"]["name"]:
            continue
        if scaler["kind"] == "HorizontalPodAutoscaler":
            return scaler["spec"].get("minReplicas", 1), scaler["spec"]["maxReplicas"]
        if scaler["kind"] == "ScaledObject":
            return scaler["spec"].get("minReplicaCount", 0), scaler["spec"].get("maxReplicaCount", 100)
    return None


def replica_range(objs, obj: dict) -> tuple[int, int]:
    if obj["kind"] == "RayService":
        return 1, 1  # one head pod (the coordinator runs no worker groups)
    bounds = autoscaler_bounds(objs, obj)
    if bounds is not None:
        return bounds
    replicas = obj["spec"].get("replicas", 1)
    return replicas, replicas


def test_nothing_an_autoscaler_owns_sets_replicas(objects):
    """`replicas:` on a Deployment an HPA or KEDA scales resets the pool at every `kubectl apply`
    until the autoscaler puts it back (gpu: 1 against KEDA's minimum of 2)."""
    _, objs = objects
    scaled = [o for o in workloads(objs) if autoscaler_bounds(objs, o) is not None]
    assert scaled, "no autoscaled workload: the draft pool is autoscaled in both overlays"
    for obj in scaled:
        assert "replicas" not in obj["spec"], f"{obj['kind']} {obj['metadata']['name']}: its autoscaler owns replicas"


def test_no_disruption_budget_blocks_a_node_drain(objects):
    """A PDB that allows no eviction at the fewest replicas its workload runs blocks every node
    drain until an operator deletes it (gpu: minAvailable 1 over the one Redis and the one head).
    Every budget lets a pod go; the workloads that run a single pod by design (the Redis, the Ray
    head) have none, as it could protect nothing; in the production overlay every workload that
    runs two or more pods keeps one through a drain."""
    overlay, objs = objects
    budgets = {}
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        (obj,) = [o for o in workloads(objs) if selector.items() <= template_labels(o).items()]
        budgets[obj["metadata"]["name"]] = pdb["spec"]
        fewest, _ = replica_range(objs, obj)
        spec = pdb["spec"]
        allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else fewest - spec["minAvailable"]
        assert allowed >= 1, f"PDB {pdb['metadata']['name']} allows no eviction at {fewest} replica(s)"
    assert not {"specdec-redis", "specdec-coordinator"} & set(budgets), sorted(budgets)
    if overlay != "gpu":
        return
    for obj in workloads(objs):
        fewest, _ = replica_range(objs, obj)
        if fewest >= 2:
            spec = budgets[obj["metadata"]["name"]]
            kept = fewest - spec["maxUnavailable"] if "maxUnavailable" in spec else spec["minAvailable"]
            assert kept >= 1, obj["metadata"]["name"]


def test_gpu_pods_land_on_gpu_nodes_and_the_targets_spread():
    """Item 3, the gpu overlay: every pod asking for a GPU requires a GPU node (node affinity on
    the GPU Operator's label) beside tolerating its taint, and the target replicas spread over
    nodes, so one node's loss does not take every target."""
    objs = render("gpu")
    gpu_pods = 0
    for owner, template in pod_templates(objs):
        if not any(GPU in c.get("resources", {}).get("limits", {}) for c in containers(template)):
            continue
        gpu_pods += 1
        spec = template["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all(
            {"key": GPU_NODE_LABEL, "operator": "In", "values": ["true"]} in term["matchExpressions"] for term in terms
        ), owner
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], owner
    assert gpu_pods == 2  # draft and target
    target = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-target")
    labels = target["spec"]["template"]["metadata"]["labels"]
    spread = [
        c
        for c in target["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
        if c["topologyKey"] == "kubernetes.io/hostname"
    ]
    assert spread, "the target replicas do not spread over nodes"
    (constraint,) = spread
    assert constraint["labelSelector"]["matchLabels"].items() <= labels.items()
    assert constraint["maxSkew"] == 1 and constraint["whenUnsatisfiable"] == "DoNotSchedule"


def test_the_dev_overlay_says_which_draft_it_ships():
    """The dev overlay's header comment names the draft its ConfigMap runs (it said "n-gram")."""
    header = [
        line.removeprefix("#").strip()
        for line in (ROOT / "deploy" / "overlays" / "dev" / "kustomization.yaml").read_text().splitlines()
        if line.startswith("#")
    ]
    text = " ".join(header)
    assert config(render("dev"))["DRAFT_MODEL"] in text and "n-gram" not in text


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_apps_health_answers_at_once_while_nothing_answers_it():
    """The readiness clients and load balancers see on the head (no kubelet probe asks it): the
    Serve deployment's HTTP GET /health answers 503 at once while Redis and every target are
    unreachable, as its gRPC Check answers NOT_SERVING -- it waited for the front's start (up to
    its 120 s wait for a target) before."""
    import asyncio

    from grpc_health.v1 import health_pb2
    from starlette.requests import Request

    from coordinator import serve_app

    deployment = serve_app.CoordinatorDeployment.func_or_class({"redis": f"redis://127.0.0.1:{free_port()}/0"})
    scope = {"type": "http", "method": "GET", "path": "/health", "headers": [], "query_string": b""}
    scope |= {"scheme": "http", "server": ("127.0.0.1", 8000), "root_path": ""}

    async def both():
        http = await asyncio.wait_for(deployment(Request(scope)), 10)
        grpc_reply = await asyncio.wait_for(deployment.Check(health_pb2.HealthCheckRequest()), 10)
        return http, grpc_reply

    http, grpc_reply = asyncio.run(both())
    assert http.status_code == 503 and b"unavailable" in http.body
    assert grpc_reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


# -- rehearsals with the real processes ------------------------------------------------------


def stop_group(process: subprocess.Popen, marker: str, grace_s: float = 5.0) -> None:
    """SIGTERM the process group we started, SIGKILL it after ``grace_s``, then any process of
    ours still running with ``marker`` (our temp dir) in its command line (Ray's daemons)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.integration
@pytest.mark.slow
def test_the_head_as_kuberay_starts_it_is_ready_before_serve_and_serve_follows():
    """The rehearsal of the probe deadlock with the real head: the dev overlay's head container
    run with the command and environment KubeRay writes into the pod (`bash -c "ulimit ...; ray
    start --head ..."`, token auth on; only ports, the Ray temp dir and the Secret's mount path
    changed), its probes run by the test as the kubelet runs them -- before any Serve exists. It
    must become Ready (else KubeRay never deploys Serve); then serveConfigV2 is deployed as the
    operator deploys it, the Serve proxy answers KubeRay's health check, the public Service's
    ports answer, and with no Redis and no target (a dependency outage) the API says NOT_SERVING
    while the head's liveness and readiness still pass."""
    import grpc
    import image_stack
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.apps.ops import secret_data

    objs = render("dev")
    service = rayservice(objs)
    container = kuberay.ray_container(service)
    work = Path(tempfile.mkdtemp(prefix="h63-head-", dir="/tmp"))  # short: Ray's unix sockets live under it
    data, _ = secret_data()
    for name, value in data.items():
        (work / name).write_bytes(value)
    secrets = {k: v.decode() for k, v in data.items()}

    manifest = ray_ports(kuberay.head_start_params(service))
    serve = serve_ports(service)
    local = {port: free_port() for port in [*manifest.values(), *serve.values()]}
    overrides = {
        "port": str(local[manifest["gcs"]]),
        "dashboard-port": str(local[manifest["dashboard"]]),
        "dashboard-agent-listen-port": str(local[manifest["agent"]]),
        "ray-client-server-port": str(local[manifest["client"]]),
        "metrics-export-port": str(local[manifest["metrics-export"]]),
        "dashboard-host": "127.0.0.1",
        "temp-dir": str(work / "ray"),
    }
    params = kuberay.head_start_params(service, overrides)
    configmap = {
        k: (str(v).replace("/etc/specdec", str(work)) if str(v).startswith("/etc/specdec/") else str(v))
        for k, v in config(objs).items()
    }
    configmap |= {
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens: Redis is "down"
        "SPECDEC_METRICS_PORT": str(free_port()),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "",
    }
    own = image_stack.container_env(container, {"specdec-config": configmap}, secrets, "127.0.0.1")
    token = secrets["auth-token"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **kuberay.head_env(service, own, params, token)}
    # the image has its venv first on PATH (the head's `ray start` and the probes' commands); here, this venv
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    probes = kuberay.head_probes(service)
    host = "127.0.0.1"

    def attempt(kind: str):
        return kuberay.probe(probes[kind], container, host, local, env)

    log = open(work / "head.log", "w")  # noqa: SIM115 - closed below
    head = subprocess.Popen(
        kuberay.head_command(service, overrides), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        # Ray is up when its own node health answers (what KubeRay injects by default) ...
        ray_health = kuberay.injected_probes(service, params)["readinessProbe"]
        up, seen = kuberay.passes_within(ray_health, lambda: kuberay.probe(ray_health, container, host, env=env), 180)
        assert up, f"ray start never came up: {seen[-3:]}\n{(work / 'head.log').read_text()[-3000:]}"
        assert not kuberay.serve_proxy_healthy(host, local[serve["http"]])  # no Serve yet: KubeRay waits
        # ... then the pod's own probes must pass within a few periods, with no Serve anywhere
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = probes[kind]
            ok, seen = kuberay.passes_within(spec, lambda kind=kind: attempt(kind), 3 * spec.get("periodSeconds", 10))
            assert ok, f"before Serve, the head's {kind} fails ({seen[-1]}): the pod never gets Ready -- deadlock"
        # the head is Ready: KubeRay deploys serveConfigV2 through the dashboard (and retries)
        body = kuberay.serve_config_json(service, local[serve["grpc"]], host, local[serve["http"]])
        dashboard = f"http://127.0.0.1:{local[manifest['dashboard']]}"
        deadline = time.monotonic() + 120
        while not (deployed := kuberay.deploy_serve(dashboard, body, token))[0] and time.monotonic() < deadline:
            time.sleep(3)
        assert deployed[0], deployed[1]
        deadline = time.monotonic() + 240
        while not kuberay.serve_proxy_healthy(host, local[serve["http"]]) and time.monotonic() < deadline:
            time.sleep(2)
        assert kuberay.serve_proxy_healthy(host, local[serve["http"]]), "the Serve proxy never answered /-/healthz"
        # the public Service's two ports: gRPC answers the standard health check, HTTP /health --
        # both NOT_SERVING (503) while Redis and every target are unreachable
        public = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "specdec-coordinator")
        ports = {
            p["name"]: local[kuberay.probe_port({"port": p["targetPort"]}, container)] for p in public["spec"]["ports"]
        }
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            # the app may still be deploying: no answer yet
            with grpc.insecure_channel(f"{host}:{ports['grpc']}") as channel, contextlib.suppress(grpc.RpcError):
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                status = reply.status
            if status is not None:
                break
            time.sleep(2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING, status
        assert http_status(f"http://{host}:{ports['http']}/health") == 503
        # a dependency outage is the API's readiness to clients, never the kubelet's reason to restart
        for kind in ("readinessProbe", "livenessProbe"):
            ok, what = attempt(kind)
            assert ok, f"with Redis and the targets down, the head's {kind} fails: {what}"
    finally:
        stop_group(head, str(work))
        log.close()


@pytest.mark.integration
def test_a_draining_replica_is_live_but_not_ready(tmp_path):
    """Readiness is "able to take sessions now", liveness "the process is sound": a draft that
    got SIGTERM refuses new sessions while its live ones finish -- not ready, still live (a
    liveness failure now would kill the sessions it is draining). The probes are the dev
    overlay's draft probes, run against the real `specdec draft` the manifest's args start."""
    import grpc
    from stack_util import save_tiny_pair

    from specdec.v1 import coordinator_pb2, draft_pb2_grpc, engine_pb2

    _, draft_dir = save_tiny_pair(tmp_path, vocab=32, seed=3, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    objs = render("dev")
    deployment = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "specdec-draft")
    (c,) = containers(deployment["spec"]["template"], init=False)
    args = c["args"]
    health = int(args[args.index("--health-port") + 1])
    port, local_health = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "REDIS_"))}  # plaintext, no registry
    argv = [sys.executable, "-m", "specdec", "draft", "--model", draft_dir, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--health-port", str(local_health), "--drain-seconds", "120"]
    process = subprocess.Popen(argv, env=env, start_new_session=True)
    ports = {health: local_health}

    def passes(kind: str) -> bool:
        return kuberay.probe(c[kind], c, "127.0.0.1", ports)[0]

    try:
        started, seen = kuberay.passes_within(
            c["startupProbe"], lambda: kuberay.probe(c["startupProbe"], c, "127.0.0.1", ports), 120
        )
        assert started, seen[-1]
        assert passes("readinessProbe") and passes("livenessProbe")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftStub(channel)
        sampling = coordinator_pb2.SamplingParams(temperature=0.0, seed=1, max_new_tokens=8)
        stub.StartSession(
            engine_pb2.StartSessionRequest(session_id="s1", prompt_token_ids=[1, 2, 3], sampling=sampling), timeout=30
        )
        process.send_signal(signal.SIGTERM)  # drains: the live session keeps it up to 120 s
        deadline = time.monotonic() + 30
        while passes("readinessProbe") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not passes("readinessProbe"), "a draining replica still says it is ready"
        assert passes("livenessProbe"), "a draining replica fails liveness: the kubelet would kill its sessions"
        assert process.poll() is None
        stub.Release(engine_pb2.ReleaseRequest(session_id="s1"), timeout=30)  # the last session ends
        assert process.wait(60) == 0
        channel.close()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
