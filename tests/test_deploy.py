"""deploy/ is validated offline: kustomize renders every overlay, every core object passes strict
schema validation against a pinned Kubernetes version, CRDs are checked structurally, and the
manifests agree with what the services actually accept and listen on."""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ["dev", "gpu"]
K8S_VERSION = "1.34.0"
PROJECT_IMAGE = re.compile(r"^ghcr\.io/specdec/specdec:\d+\.\d+\.\d+(-cuda)?$")
THIRD_PARTY = re.compile(r"^(redis:7\.\d+\.\d+-alpine|jaegertracing/jaeger:2\.\d+\.\d+)$")  # Jaeger v2
CRD_KINDS = {"RayService", "PodMonitor", "ScaledObject"}  # checked structurally below


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is needed to render deploy/"
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request):
    return request.param, render(request.param)


def pod_templates(objs):
    """(owner name, pod template) for every workload, the RayService head included."""
    for obj in objs:
        kind = obj["kind"]
        if kind in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]
        elif kind == "RayService":
            yield obj["metadata"]["name"], obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]


def containers(template, init=True):
    spec = template["spec"]
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


def config(objs) -> dict:
    return next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "specdec-config")["data"]


def test_core_objects_validate_strictly(objects):
    import kubernetes_validate

    _, objs = objects
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_expected_objects_exist(objects):
    overlay, objs = objects
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    expected = {
        ("Deployment", "specdec-draft"),
        ("Service", "specdec-draft"),
        # the draft pool's autoscaler: CPU in dev, KEDA on the busy fraction in gpu
        ("HorizontalPodAutoscaler" if overlay == "dev" else "ScaledObject", "specdec-draft"),
        ("StatefulSet", "specdec-target"),
        ("RayService", "specdec-coordinator"),
        ("Service", "specdec-coordinator"),
        ("StatefulSet", "specdec-redis"),
        ("ConfigMap", "specdec-config"),
    }
    assert expected <= kinds
    assert sum(o["kind"] == "PodDisruptionBudget" for o in objs) >= 2
    assert sum(o["kind"] == "NetworkPolicy" for o in objs) >= 3
    if overlay == "dev":
        assert ("Deployment", "specdec-jaeger") in kinds
    draft_svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "specdec-draft")
    assert draft_svc["spec"]["clusterIP"] == "None"  # per-replica routing through the registry


def test_rayservice_structure(objects):
    _, objs = objects
    rs = next(o for o in objs if o["kind"] == "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    grpc = serve_config["grpc_options"]
    for path in grpc["grpc_servicer_functions"]:  # importable, as Serve's proxy will import them
        module, attr = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), attr))
    (app,) = serve_config["applications"]
    assert app["route_prefix"] == "/"  # without it Serve's proxy never routes gRPC
    module, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    builder(app["args"])  # builds: every arg is a coordinator setting with a valid value
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    ports = {p["containerPort"] for c in containers(head, init=False) for p in c.get("ports", [])}
    assert grpc["port"] in ports
    import ray

    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


# What KubeRay adds to the labels of the head pod it creates (ray-operator/controllers/ray/common/
# pod.go: labelPod, BuildPod): ray.io/serve is "true" while the head's Serve proxy answers
# KubeRay's health check (rayservice_controller.go: updateHeadPodServeLabel).
KUBERAY_HEAD_LABELS = {"ray.io/node-type": "head", "ray.io/is-ray-node": "yes", "ray.io/serve": "true"}


def pod_labels(objs, owner: str, template) -> dict:
    """The labels a pod of ``template`` carries: the template's, and KubeRay's on the head."""
    kuberay = any(o["kind"] == "RayService" and o["metadata"]["name"] == owner for o in objs)
    return {**template["metadata"]["labels"], **(KUBERAY_HEAD_LABELS if kuberay else {})}


def test_every_service_selects_a_pod_template(objects):
    _, objs = objects
    templates = [t for _, t in pod_templates(objs)]
    labelled = [(pod_labels(objs, owner, t), t) for owner, t in pod_templates(objs)]
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        matching = [t for labels, t in labelled if selector.items() <= labels.items()]
        assert matching, f"Service {svc['metadata']['name']} selects no pod template"
        named_ports = {
            p["name"]: p["containerPort"]
            for t in matching
            for c in containers(t, init=False)
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in named_ports or target in named_ports.values(), (svc["metadata"]["name"], target)
    for obj in objs:
        if obj["kind"] in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            labels = obj["spec"]["selector"]["matchLabels"]
            assert any(labels.items() <= t["metadata"]["labels"].items() for t in templates)


def test_every_container_has_limits_security_and_probes(objects):
    _, objs = objects
    for owner, template in pod_templates(objs):
        assert template["spec"].get("securityContext", {}).get("runAsNonRoot") is True, owner
        for c in containers(template):
            res = c.get("resources", {})
            assert res.get("requests") and res.get("limits"), (owner, c["name"])
            sec = c.get("securityContext", {})
            assert sec.get("allowPrivilegeEscalation") is False and sec.get("readOnlyRootFilesystem") is True, c["name"]
        for c in containers(template, init=False):
            assert "readinessProbe" in c and "livenessProbe" in c, (owner, c["name"])


def test_every_image_is_the_projects_or_a_pinned_dependency(objects):
    _, objs = objects
    for owner, template in pod_templates(objs):
        for c in containers(template):
            image = c["image"]
            assert PROJECT_IMAGE.match(image) or THIRD_PARTY.match(image), (owner, image)


def test_every_package_installed_at_start_is_pinned_to_what_make_installs(objects):
    """An init container that pip-installs an unpinned package runs whatever the index serves
    that day (issue 24, item 16): every one pins the version the Makefile installs and tests."""
    overlay, objs = objects
    makefile = (ROOT / "Makefile").read_text()
    installs = 0
    for owner, template in pod_templates(objs):
        for c in containers(template):
            command = c.get("command", []) + c.get("args", [])
            if "pip" not in command:
                continue
            packages = [a for a in command[command.index("install") + 1 :] if not a.startswith("-") and a != "/models"]
            for package in packages:
                installs += 1
                assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", package), (owner, package)
                assert package in makefile, (owner, package, "not the version make installs")
    assert installs > 0 or overlay != "dev"  # dev fetches the default models this way; gpu mounts its own


def test_every_pod_is_behind_a_network_policy_and_ray_needs_its_token(objects):
    """Issue 24, item 12: the Ray head must not take jobs from any pod of the cluster -- token
    auth on, never switched off, and a NetworkPolicy on every pod (the coordinator's admitting
    only the public ports from outside Ray)."""
    _, objs = objects
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]

    def covered(labels):
        return [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]

    for owner, template in pod_templates(objs):
        assert covered(template["metadata"]["labels"]), f"{owner}: no NetworkPolicy selects its pods"
        for c in containers(template):
            for env in c.get("env", []):
                assert not (env["name"] == "RAY_AUTH_MODE" and env.get("value") == "disabled"), owner
    service = next(o for o in objs if o["kind"] == "RayService")
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    head_labels = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    (policy,) = covered(head_labels)
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert {p["port"] for r in open_rules for p in r["ports"]} == {9000, 8000}  # the public API only
    assert "RAY_AUTH_MODE=disabled" not in (ROOT / "Dockerfile").read_text()


def expand(arg: str, env: dict) -> str:
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], arg)


def test_cli_flags_and_ports_agree_with_the_services(objects):
    """The container args parse with the real `specdec` CLI, and the port a service listens on is
    the containerPort, the probe port and the Service's target."""
    from specdec.apps.cli import build_parser

    _, objs = objects
    env = {**config(objs), "POD_IP": "10.0.0.1"}
    parser = build_parser()
    seen = set()
    for owner, template in pod_templates(objs):
        for c in containers(template, init=False):
            if not PROJECT_IMAGE.match(c["image"]) or "args" not in c:
                continue
            args = parser.parse_args([expand(a, env) for a in c["args"]])
            seen.add(args.command)
            grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
            assert args.port == grpc_port, (owner, args.port, grpc_port)
            # probed on the plaintext health port (the service port serves mutual TLS)
            health_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "health")
            assert args.health_port == health_port != args.port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == args.health_port
            assert args.advertise == f"10.0.0.1:{args.port}"
            assert args.redis == env["REDIS_URL"]
            assert {"name": "specdec-config"} in [e.get("configMapRef") for e in c["envFrom"]]
    assert seen == {"draft", "target"}
    # the model specs the config names are what the services will be asked to load
    assert env["TARGET_TP"].isdigit()
    # the coordinator's settings in the ConfigMap are valid settings (what the Serve replica reads)
    from coordinator import settings

    coordinator_config = settings.config_from(settings.values_from_env(env))
    assert coordinator_config.default_k == int(env["SPECDEC_NUM_SPECULATIVE_TOKENS"]) <= coordinator_config.max_k


def test_every_config_key_is_read_and_no_setting_is_written_twice(objects):
    """Issue 25: a ConfigMap key nothing reads is a setting that silently does nothing, and a
    setting both in the ConfigMap and in serveConfigV2 drifts. Every key is a $(KEY) in a
    rendered manifest, an environment variable the code reads, or one of a library's (OTEL_,
    HF_); the Serve app's args repeat none of them."""
    _, objs = objects
    rendered = yaml.safe_dump_all(objs)
    code = "\n".join(p.read_text() for d in ("specdec", "coordinator") for p in (ROOT / d).rglob("*.py"))
    from coordinator import settings

    setting_env = {settings.env_name(s) for s in settings.SETTINGS}
    for key in config(objs):
        used = f"$({key})" in rendered or f'"{key}"' in code or key in setting_env or key.startswith(("OTEL_", "HF_"))
        assert used, f"ConfigMap key {key} is read by nothing"
    rs = next(o for o in objs if o["kind"] == "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    twice = {settings.env_name(settings.BY_NAME[name]) for name in app.get("args") or {}} & set(config(objs))
    assert not twice, f"written both in serveConfigV2 and the ConfigMap: {twice}"


def test_gpu_overlay_shards_the_target_and_gives_drafts_their_own_gpus():
    objs = render("gpu")
    tp = int(config(objs)["TARGET_TP"])
    target = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-target")
    (container,) = containers(target["spec"]["template"], init=False)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == tp == 2
    draft = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "specdec-draft")
    (dc,) = containers(draft["spec"]["template"], init=False)
    assert int(dc["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]  # KEDA's ScaledObject owns it
    scaled = next(o for o in objs if o["kind"] == "ScaledObject")
    assert scaled["spec"]["maxReplicaCount"] > scaled["spec"]["minReplicaCount"]
    assert all(not t["spec"].get("initContainers") for _, t in pod_templates(objs))  # models from the PVC


def test_dockerfile_structure():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    base = next(line for line in lines if line.startswith("FROM ")).split()[1]
    if base.startswith("${"):  # a build argument (make image-local passes its own base): its default
        base = next(line for line in lines if line.startswith(f"ARG {base[2:-1]}=")).split("=", 1)[1]
    assert ":" in base and not base.endswith(":latest")  # pinned by tag
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("root", "0")
    assert not re.search(r"(?i)(password|secret|token|api_key)\s*=", text)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT"))
    assert shlex.split(entry.replace("[", "").replace("]", "").replace(",", " "))[1:] == ["specdec"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'specdec = "specdec.apps.cli:main"' in pyproject  # the entrypoint exists in the package
    # target models are mounted, never baked in; the only model copied is the shipped distilled draft
    copies = [line.split()[1:] for line in lines if line.startswith("COPY")]
    assert "gguf" not in text.lower()
    assert [c for c in copies if "models" in " ".join(c)] == [["models", "./models"]]
    assert "SPECDEC_MODELS_DIR=/opt/specdec/models" in text


def test_pods_that_would_fail_or_go_unprotected(objects):
    """Issue 25, item 4: a writable HOME under every read-only root filesystem, a startup probe
    wherever a model loads, and the tensor-parallel target's /dev/shm in memory; in the production
    (gpu) overlay the draft and target pools are protected one pod at a time (maxUnavailable 1 over
    >= 2 replicas) and the single Redis and coordinator head have no PDB, which would block every
    node drain (issue 63; tests/test_deploy_probes.py checks every budget)."""
    overlay, objs = objects
    for owner, template in pod_templates(objs):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in containers(template, init=False):
            if c["image"].startswith("ghcr.io/specdec/") and c["securityContext"].get("readOnlyRootFilesystem"):
                home = {e["name"]: e.get("value") for e in c.get("env", [])}.get("HOME")
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                assert home in mounts and "emptyDir" in volumes[mounts[home]], (owner, c["name"], home)
                assert "startupProbe" in c, (owner, c["name"])
    tp = int(config(objs)["TARGET_TP"])
    target = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-target")
    shm = {m["mountPath"]: m["name"] for c in containers(target["spec"]["template"]) for m in c.get("volumeMounts", [])}
    if tp > 1:
        volume = next(v for v in target["spec"]["template"]["spec"]["volumes"] if v["name"] == shm["/dev/shm"])
        assert volume["emptyDir"]["medium"] == "Memory"
    if overlay != "gpu":
        return
    pdbs = {
        o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: o["spec"]
        for o in objs
        if o["kind"] == "PodDisruptionBudget"
    }
    assert set(pdbs) == {"draft", "target"}
    assert all(spec.get("maxUnavailable") == 1 and "minAvailable" not in spec for spec in pdbs.values())
    scaled = next(o for o in objs if o["kind"] == "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] >= 2 and target["spec"]["replicas"] >= 2


def test_the_scaling_chain_is_complete():
    """Issue 25, item 3, on the gpu overlay: the metric the KEDA trigger queries is one the code
    exports, from the container the PodMonitor scrapes, on the port the service serves /metrics
    on, which the NetworkPolicy lets Prometheus reach; and KEDA scales the draft Deployment."""
    from prometheus_client import generate_latest

    from specdec.telemetry import metrics

    objs = render("gpu")
    exported = generate_latest(metrics.REGISTRY).decode()
    (scaled,) = [o for o in objs if o["kind"] == "ScaledObject"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    metric = re.search(r"(specdec_[a-z_]+)\{", query).group(1)
    assert re.search(rf"^{metric} ", exported, re.M), f"{metric} is not exported"
    container = re.search(r'container="([^"]+)"', query).group(1)
    namespace = re.search(r'namespace="([^"]+)"', query).group(1)
    draft = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "specdec-draft")
    assert namespace == draft["metadata"]["namespace"]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdec-draft"}
    template = draft["spec"]["template"]
    (served,) = [c for c in template["spec"]["containers"] if c["name"] == container]
    (monitor,) = [o for o in objs if o["kind"] == "PodMonitor"]
    labels = template["metadata"]["labels"]
    selector = monitor["spec"]["selector"]
    assert selector["matchLabels"].items() <= labels.items()
    assert all(labels[e["key"]] in e["values"] for e in selector["matchExpressions"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    port = next(p["containerPort"] for p in served["ports"] if p["name"] == endpoint["port"])
    args = served["args"]
    assert int(args[args.index("--metrics-port") + 1]) == port
    admitted = [
        rule
        for policy in objs
        if policy["kind"] == "NetworkPolicy" and policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == port for p in rule.get("ports", []))
    ]
    assert admitted and all("namespaceSelector" in f for r in admitted for f in r["from"])  # Prometheus's namespace


def test_the_rayservice_pod_templates_validate_as_kubernetes_pod_templates(objects):
    """The CRD check beyond structure (issue 25, item 6): the RayService embeds ordinary pod
    templates, validated here strictly against Kubernetes' own schema (as a core PodTemplate),
    and its KubeRay fields take the values KubeRay's API reference allows."""
    import kubernetes_validate

    _, objs = objects
    rs = next(o for o in objs if o["kind"] == "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    for group in groups:
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group["template"]}
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay: map[string]string
    assert cluster["authOptions"]["mode"] in ("disabled", "token")
    assert isinstance(rs["spec"]["serveConfigV2"], str)


def test_redis_has_a_maxmemory_under_its_limit_and_never_evicts(objects):
    """The session log is bounded (issue 42, item 1): Redis refuses writes past maxmemory rather
    than evicting a lease or a heartbeat, and maxmemory leaves the container room to rewrite its
    append-only file."""
    _, objs = objects
    redis_set = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-redis")
    (server,) = [c for c in containers(redis_set["spec"]["template"], init=False) if c["name"] == "redis"]
    args = server["args"]
    option = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert option["--maxmemory-policy"] == "noeviction"
    maxmemory = int(option["--maxmemory"].removesuffix("mb")) << 20
    limit = server["resources"]["limits"]["memory"]
    assert limit.endswith("Mi") and maxmemory <= 0.8 * (int(limit.removesuffix("Mi")) << 20)


def test_every_service_runs_with_the_internal_token_tls_api_keys_and_the_redis_password(objects):
    """Issue 42, item 3: from the Secret `specdec secrets` makes. Draft, target and coordinator
    pods mount it where specdec-config's TLS / token / API-key paths point; each reads the Redis
    password from it, and Redis requires that password (its probes' redis-cli too)."""
    from coordinator import api_keys
    from specdec.runtime import security

    _, objs = objects
    env = config(objs)
    paths = {
        name: env[name]
        for name in (
            security.CERT_ENV,
            security.KEY_ENV,
            security.CA_ENV,
            security.TOKEN_FILE_ENV,
            api_keys.API_KEY_FILE_ENV,
        )
    }
    assert env[security.SERVER_NAME_ENV] and all(p.startswith("/etc/specdec/") for p in paths.values())
    for owner, template in pod_templates(objs):
        for c in containers(template, init=False):
            if not PROJECT_IMAGE.match(c["image"]):
                continue
            secret_volumes = {
                v["name"]
                for v in template["spec"]["volumes"]
                if v.get("secret", {}).get("secretName") == "specdec-secrets"
            }
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/etc/specdec") in secret_volumes, (owner, c["name"])
            password = next(e for e in c["env"] if e["name"] == security.REDIS_PASSWORD_ENV)
            # draft and target: the registry's ACL user (test_replica_pods_hold_only_what_they_need)
            key = "redis-password" if owner == "specdec-coordinator" else "redis-replica-password"
            assert password["valueFrom"]["secretKeyRef"] == {"name": "specdec-secrets", "key": key}
    redis_set = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-redis")
    (server,) = [c for c in containers(redis_set["spec"]["template"], init=False) if c["name"] == "redis"]
    assert server["args"][server["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in server["env"]}
    assert refs == {
        "REDIS_PASSWORD": "redis-password",
        "REDISCLI_AUTH": "redis-password",
        "REDIS_REPLICA_PASSWORD": "redis-replica-password",
    }
    # what `specdec secrets` writes holds every file these paths name
    from specdec.apps.ops import secret_data

    data, _ = secret_data()
    assert {p.removeprefix("/etc/specdec/") for p in paths.values()} <= set(data)


def replica_acl(objs) -> list[str]:
    """The ACL rule of the Redis user draft and target pods log in as (redis.yaml's --user)."""
    redis_set = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specdec-redis")
    (server,) = [c for c in containers(redis_set["spec"]["template"], init=False) if c["name"] == "redis"]
    args = server["args"]
    start = args.index("--user") + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def test_replica_pods_hold_only_what_they_need(objects):
    """Issue 62, item 10: a draft or target pod gets the files its own TLS and token settings
    name, and nothing else of the Secret -- no API keys (a replica never checks one) and no
    full-access Redis password: it logs in to Redis as the registry's ACL user, which may touch
    its own records' keys only."""
    from specdec.runtime import security

    _, objs = objects
    env = config(objs)
    needed = {
        env[name].removeprefix("/etc/specdec/")
        for name in security.ENV_NAMES
        if env.get(name, "").startswith("/etc/specdec/")
    }
    assert {"auth-token", "tls.key"} <= needed
    for owner, template in pod_templates(objs):
        if owner not in ("specdec-draft", "specdec-target"):
            continue
        (secret,) = [v["secret"] for v in template["spec"]["volumes"] if "secret" in v]
        assert {item["key"] for item in secret.get("items", [])} == needed, owner
        assert all(item["path"] == item["key"] for item in secret["items"])  # where the config says
        (server,) = [c for c in containers(template, init=False) if c["name"] in ("draft", "target")]
        values = {e["name"]: e.get("value") for e in server["env"]}
        assert values[security.REDIS_USERNAME_ENV] == replica_acl(objs)[0], owner
        keys = {
            e["valueFrom"]["secretKeyRef"]["key"] for e in server["env"] if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert keys == {"redis-replica-password"}, owner
    from specdec.apps.ops import secret_data

    data, _ = secret_data()
    assert "redis-replica-password" in data and data["redis-replica-password"] != data["redis-password"]


@pytest.mark.integration
def test_the_replicas_redis_user_may_heartbeat_and_nothing_else():
    """The ACL rule deploy/ gives Redis, on a real redis-server: the replicas' user registers,
    refreshes and deregisters a (signed) record, and is refused the session log, other keys,
    reading, listing and administration -- a replica pod cannot rewrite committed tokens."""
    import asyncio

    import redis.exceptions

    from specdec.runtime.redis_embedded import EmbeddedRedis
    from specdec.runtime.registry import Registry, Replica

    rule = [part.replace("$(REDIS_REPLICA_PASSWORD)", "replica-pw") for part in replica_acl(render("dev"))]
    user = rule[0]
    replica = Replica("target", "t1", "10.0.0.5:50062", "m", "fp", vocab_size=100, capacity=8)

    async def go(url: str) -> None:
        as_replica = Registry(url.replace("redis://", f"redis://{user}:replica-pw@"), token="t0ken")
        await as_replica.publish(replica, ttl=30)
        coordinator = Registry(url, token="t0ken")  # the default user: the coordinator's
        assert await coordinator.replicas("target") == [replica]
        refused = (
            as_replica.redis.xadd("specdec:req:r1:out", {"chunk": "forged"}),
            as_replica.redis.set("specdec:req:r1:lease", "me"),
            as_replica.redis.hset("specdec:other", mapping={"a": "1"}),
            as_replica.redis.hgetall(replica.key),
            as_replica.redis.keys("*"),
            as_replica.redis.flushall(),
            as_replica.redis.config_set("maxmemory", "1"),
        )
        for call in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await call
        await as_replica.remove(replica)
        assert await coordinator.replicas("target") == []
        for client in (as_replica, coordinator):
            await client.close()

    with EmbeddedRedis(extra_args=["--user", *rule]) as server:
        asyncio.run(go(server.url))
