"""What the KubeRay operator and the kubelet do with the RayService's head pod, emulated on one
machine so that a rehearsal can run the head as a cluster would (tests/test_deploy_probes.py runs
it as a local process, `make image-stack` as a container).

Each rule below follows KubeRay's own code (github.com/ray-project/kuberay, ray-operator/,
read at v1.7.0; the behaviour cited has been there since 1.1 unless said otherwise):

- the head container's command (controllers/ray/common/pod.go: BuildPod, setMissingRayStartParams,
  generateRayStartCommand, convertParamMap; utils/util.go: GetContainerCommand): when the container
  sets no `ray start` of its own, KubeRay runs `/bin/bash -c -- "ulimit -n ...; ray start --head
  <params>"` with the group's rayStartParams plus `block`, `dashboard-host`, `metrics-export-port`,
  `dashboard-agent-listen-port` and num-cpus / memory / num-gpus from the container's limits;
- its environment (pod.go: setContainerEnvVars, SetContainerTokenAuthEnvVars): RAY_ADDRESS,
  RAY_PORT, the RayService timeouts, the auth mode and token with `authOptions: token`;
- the probes it injects into the Ray container where the template has none (pod.go:
  initLivenessAndReadinessProbe; utils/constant.go): for Ray >= 2.53 an HTTP GET of the dashboard
  agent's /api/healthz (raylet and, on the head, GCS), before that `wget` of the agent's
  /api/local_raylet_healthz and the dashboard's /api/gcs_healthz;
- when it deploys Serve (rayservice_controller.go: reconcileServe): only once the head pod is
  running and Ready, by PUT of serveConfigV2 (as JSON) to the dashboard's /api/serve/applications/
  (utils/dashboardclient/dashboard_httpclient.go, the token in `x-ray-authorization`);
- how it decides the head serves traffic (rayservice_controller.go: updateHeadPodServeLabel;
  utils/httpproxy_httpclient.go): GET /-/healthz on the container port named `serve` answering 200
  sets the pod label `ray.io/serve=true`, which the `<name>-serve-svc` Service selects on.

The kubelet's side is :func:`probe`: one attempt of a probe as the kubelet runs it (httpGet: a
status in [200, 400); grpc: the standard health check answering SERVING for its `service`;
tcpSocket: a connection; exec: exit status 0).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import yaml

# utils/constant.go
DEFAULT_GCS_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_AGENT_PORT = 52365  # dashboard-agent-listen-port: the probes' port
DEFAULT_METRICS_EXPORT_PORT = 8080
DEFAULT_SERVE_PORT = 8000
SERVE_PORT_NAME = "serve"  # and "serve-*" (KubeRay >= 1.6.0): the ports `<name>-serve-svc` carries
SERVE_LABEL = "ray.io/serve"  # "true" while the head's Serve proxy answers /-/healthz
SERVE_PROXY_HEALTH = "/-/healthz"
UNIFIED_HEALTH_PATH = "/api/healthz"
UNIFIED_HEALTH_SINCE = (2, 53, 0)  # pod.go: supportsUnifiedHealthCheck
ULIMIT = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}"
# convertParamMap: flags taking an explicit boolean (every other "true" is a bare flag, "false" dropped)
EXPLICIT_BOOLEANS = ("log-color", "include-dashboard", "include-log-monitor")
# the labels KubeRay puts on a RayService's head pod beside the template's (pod.go: labelPod, BuildPod)
HEAD_POD_LABELS = ("ray.io/cluster", "ray.io/node-type", "ray.io/group", "ray.io/is-ray-node", SERVE_LABEL)


class KubeRayError(RuntimeError):
    """The manifest asks for something this emulation does not do (it says what)."""


def head_group(service: dict) -> dict:
    return service["spec"]["rayClusterConfig"]["headGroupSpec"]


def ray_container(service: dict) -> dict:
    return head_group(service)["template"]["spec"]["containers"][0]  # utils.RayContainerIndex


def quantity(value) -> float:
    """A Kubernetes resource quantity ("2", "500m", "4Gi", "1G") as a number."""
    text = str(value)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or match.group(2) not in ("", *suffixes):
        raise KubeRayError(f"not a quantity: {value!r}")
    return float(match.group(1)) * suffixes.get(match.group(2), 1)


def head_start_params(service: dict, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The `ray start --head` parameters KubeRay runs: the group's rayStartParams, what
    setMissingRayStartParams adds, the resources generateRayStartCommand reads off the limits
    (rounded up, as Quantity.Value() does), then ``overrides`` (a rehearsal's ports)."""
    params = {k: str(v) for k, v in head_group(service).get("rayStartParams", {}).items()}
    params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(DEFAULT_METRICS_EXPORT_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DEFAULT_AGENT_PORT))
    resources = ray_container(service).get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    cpu = limits.get("cpu", requests.get("cpu"))
    if "num-cpus" not in params and cpu is not None:
        params["num-cpus"] = str(-int(-quantity(cpu) // 1))
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(-int(-quantity(limits["memory"]) // 1))
    if "num-gpus" not in params and quantity(limits.get("nvidia.com/gpu", 0)):
        params["num-gpus"] = str(int(quantity(limits["nvidia.com/gpu"])))
    return {**params, **(overrides or {})}


def ray_start_command(params: dict[str, str]) -> str:
    """generateRayStartCommand + convertParamMap: the flags sorted by name."""
    flags = []
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in EXPLICIT_BOOLEANS:
            if value.lower() == "true":
                flags.append(f"--{key}")
        else:
            flags.append(f"--{key}={value}")
    return " ".join(["ray", "start", "--head", *flags])


def head_command(service: dict, overrides: dict[str, str] | None = None) -> list[str]:
    """The head container's command and args as KubeRay writes them into the pod."""
    container = ray_container(service)
    if container.get("command") or container.get("args"):
        # KubeRay would run them before `ray start` (or instead of it): not what deploy/ does
        raise KubeRayError("the head container sets its own command/args; this emulation runs only KubeRay's")
    return ["/bin/bash", "-c", "--", f"{ULIMIT}; {ray_start_command(head_start_params(service, overrides))}"]


def head_env(
    service: dict, own: dict[str, str], params: dict[str, str], token: str, namespace: str = "specdec"
) -> dict[str, str]:
    """The head container's environment: ``own`` (what the template gives it: envFrom, env),
    then what KubeRay appends (setContainerEnvVars: RAY_PORT, RAY_ADDRESS, ... only where the
    template does not set them; the token with authOptions: token)."""
    name = service["metadata"]["name"]
    gcs_port = params.get("port", str(DEFAULT_GCS_PORT))
    added = {
        "RAY_CLUSTER_NAME": f"{name}-cluster",
        "RAY_CLUSTER_NAMESPACE": namespace,
        "RAY_CLOUD_INSTANCE_ID": f"{name}-head",
        "RAY_NODE_TYPE_NAME": "headgroup",
        "KUBERAY_GEN_RAY_START_CMD": ray_start_command(params),
        "RAY_PORT": gcs_port,
        "RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO": "0",
        "RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS": "5",
        "RAY_SERVE_KV_TIMEOUT_S": "5",
        "RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
    }
    auth = service["spec"]["rayClusterConfig"].get("authOptions", {}).get("mode")
    if auth == "token":
        added |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    return {**own, **{k: v for k, v in added.items() if k not in own}}


def version_at_least(version: str, floor: tuple[int, ...]) -> bool:
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[: len(floor)])
    return parts >= floor


def injected_probes(service: dict, params: dict[str, str]) -> dict[str, dict]:
    """The liveness and readiness probes KubeRay gives the head's Ray container where its
    template has none (initLivenessAndReadinessProbe, with ENABLE_PROBES_INJECTION left on)."""
    agent = int(params.get("dashboard-agent-listen-port", DEFAULT_AGENT_PORT))
    if version_at_least(service["spec"]["rayClusterConfig"]["rayVersion"], UNIFIED_HEALTH_SINCE):
        handler: dict = {"httpGet": {"path": UNIFIED_HEALTH_PATH, "port": agent}}
    else:
        dashboard = int(params.get("dashboard-port", DEFAULT_DASHBOARD_PORT))
        checks = [
            f"wget --tries 1 -T 2 -q -O- http://localhost:{agent}/api/local_raylet_healthz | grep success",
            f"wget --tries 1 -T 10 -q -O- http://localhost:{dashboard}/api/gcs_healthz | grep success",
        ]
        handler = {"exec": {"command": ["bash", "-c", " && ".join(checks)]}}
    return {
        "readinessProbe": {**handler, "initialDelaySeconds": 10, "timeoutSeconds": 5, "periodSeconds": 5,
                           "successThreshold": 1, "failureThreshold": 10},
        "livenessProbe": {**handler, "initialDelaySeconds": 30, "timeoutSeconds": 5, "periodSeconds": 5,
                          "successThreshold": 1, "failureThreshold": 120},
    }  # fmt: skip


def head_probes(service: dict) -> dict[str, dict]:
    """The probes the head's Ray container runs with: the template's own, KubeRay's injected
    liveness / readiness where it writes none (a startup probe is never injected)."""
    container = ray_container(service)
    own = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}
    injected = injected_probes(service, head_start_params(service))
    return {**{k: v for k, v in injected.items() if k not in own}, **own}


def probe_port(handler: dict, container: dict) -> int:
    """A probe handler's port: a number, or the name of one of the container's ports."""
    port = handler["port"]
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if port not in named:
        raise KubeRayError(f"probe port {port!r} is no port of the container ({sorted(filter(None, named))})")
    return named[port]


def probe(spec: dict, container: dict, host: str, ports: dict[int, int] | None = None, env=None) -> tuple[bool, str]:
    """One attempt of the probe ``spec`` as the kubelet makes it against ``host``; ``ports``
    maps the manifest's ports to where a rehearsal runs them. -> (success, what it saw)."""
    ports = ports or {}
    timeout = float(spec.get("timeoutSeconds", 1))
    if "httpGet" in spec:
        handler = spec["httpGet"]
        port = ports.get(probe_port(handler, container), probe_port(handler, container))
        url = f"http://{host}:{port}{handler.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return 200 <= reply.status < 400, f"GET {url}: {reply.status}"
        except urllib.error.HTTPError as error:
            return 200 <= error.code < 400, f"GET {url}: {error.code}"
        except OSError as error:
            return False, f"GET {url}: {error}"
    if "grpc" in spec:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        handler = spec["grpc"]
        port = ports.get(handler["port"], handler["port"])
        service_name = handler.get("service", "")
        with grpc.insecure_channel(f"{host}:{port}") as channel:  # the kubelet's gRPC probes speak no TLS
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service_name), timeout=timeout
                )
            except grpc.RpcError as error:
                return False, f"gRPC health {host}:{port} {service_name!r}: {error.code().name}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"gRPC health {port} {service_name!r}: {status}"
    if "tcpSocket" in spec:
        port = ports.get(probe_port(spec["tcpSocket"], container), probe_port(spec["tcpSocket"], container))
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True, f"TCP {host}:{port}: connected"
        except OSError as error:
            return False, f"TCP {host}:{port}: {error}"
    if "exec" in spec:
        command = spec["exec"]["command"]
        done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=timeout + 5)
        return done.returncode == 0, f"exec: exit {done.returncode}"
    raise KubeRayError(f"a probe with no handler this emulation knows: {sorted(spec)}")


def passes_within(spec: dict, attempt: Callable[[], tuple[bool, str]], budget_s: float) -> tuple[bool, list[str]]:
    """Probe every periodSeconds (at most ``budget_s``) until one attempt succeeds; what each saw."""
    period = float(spec.get("periodSeconds", 10))
    seen: list[str] = []
    deadline = time.monotonic() + budget_s
    while True:
        ok, what = attempt()
        seen.append(what)
        if ok:
            return True, seen
        if time.monotonic() + period > deadline:
            return False, seen
        time.sleep(period)


def serve_config_json(service: dict, grpc_port: int, http_host: str, http_port: int) -> bytes:
    """serveConfigV2 as KubeRay submits it (YAML -> JSON), on a rehearsal's ports."""
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    config["grpc_options"]["port"] = grpc_port
    config["http_options"] = {**config.get("http_options", {}), "host": http_host, "port": http_port}
    return json.dumps(config).encode()


def deploy_serve(dashboard_url: str, body: bytes, token: str | None) -> tuple[bool, str]:
    """UpdateDeployments: PUT the Serve config to the dashboard, as the operator does once the head
    is Ready (it retries at every reconcile until it is accepted)."""
    request = urllib.request.Request(f"{dashboard_url}/api/serve/applications/", data=body, method="PUT")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("x-ray-authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return 200 <= reply.status < 300, f"PUT {reply.status}"
    except urllib.error.HTTPError as error:
        return False, f"PUT {error.code}: {error.read()[:500]!r}"
    except OSError as error:
        return False, f"PUT: {error}"


def serve_proxy_healthy(host: str, port: int) -> bool:
    """CheckProxyActorHealth: what sets the head's ray.io/serve label to "true"."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{SERVE_PROXY_HEALTH}", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False
