"""tools/image.py and tools/image_stack.py (issue 44), the parts that need no container engine:
the base and build commands, the constraints taken from the venv, and how the separate-containers
stack turns the rendered manifests into container arguments and environments -- on the real
deploy/ overlay, so a manifest change that the local stack could not run fails here. The
containers themselves run in `make image-smoke` and `make image-stack` (docs/image.md says why not
in `make test`)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import image  # noqa: E402  (tools/ is not a package)
import image_stack  # noqa: E402


def test_constraints_keep_every_pin_but_the_project_and_editable_lines():
    freeze = "\n".join(
        [
            "# Editable install with no version control (specdec==0.1.0)",
            "-e /work/main",
            "torch==2.13.0+cpu",
            "grpcio==1.85.1",
            "specdec==0.1.0",
            "somepkg @ file:///tmp/somepkg.whl",
            "Ray==2.60.0",
        ]
    )
    assert image.constraints_from_freeze(freeze) == "torch==2.13.0+cpu\ngrpcio==1.85.1\nRay==2.60.0\n"


def test_the_base_is_minimal_debian_with_a_compiler_and_the_build_gets_the_ca_as_a_secret():
    command = image.mmdebstrap_command(Path("/tmp/base.tar"))
    assert command[:2] == ["mmdebstrap", "--variant=minbase"]
    included = next(c for c in command if c.startswith("--include=")).split("=", 1)[1].split(",")
    assert {"python3", "python3-venv", "gcc", "ca-certificates"} <= set(included)
    assert command[-3:] == ["bookworm", "/tmp/base.tar", image.DEBIAN_MIRROR]
    with_ca = image.build_command("t:1", "base:1", Path("/etc/ssl/certs/ca-certificates.crt"))
    assert with_ca[with_ca.index("--secret") + 1] == "id=ca,src=/etc/ssl/certs/ca-certificates.crt"
    assert "BASE_IMAGE=base:1" in with_ca and with_ca[-1] == str(ROOT)
    assert "--secret" not in image.build_command("t:1", "base:1", None)
    # the CA reaches pip only through the secret mount, never as a build argument or a COPY
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("--mount=type=secret,id=ca") == 2
    assert "ca-certificates.crt" not in dockerfile


def test_the_torch_pin_is_read_from_the_dockerfile():
    assert image.torch_pin() == image.torch_pin().strip() and image.torch_pin().count(".") == 2
    assert f"TORCH_VERSION ?= {image.torch_pin()}" in (ROOT / "Makefile").read_text()


def test_kubernetes_expansion():
    env = {"A": "1", "B": "x"}
    assert image_stack.expand("$(A):$(B)", env) == "1:x"
    assert image_stack.expand("$(MISSING)", env) == "$(MISSING)"  # left as written, as Kubernetes does
    assert image_stack.expand("$$(A)", env) == "$(A)"  # $$ escapes
    assert image_stack.expand("plain", env) == "plain"


def test_flags_are_replaced_and_a_missing_flag_is_an_error():
    args = ["target", "--host", "0.0.0.0", "--port", "50062"]
    assert image_stack.with_flags(args, {"--host": "127.0.0.1"}) == ["target", "--host", "127.0.0.1", "--port", "50062"]
    with pytest.raises(image.ImageError, match="--health-port"):
        image_stack.with_flags(args, {"--health-port": "1"})


def test_the_smoke_names_each_answer_that_differs():
    inside = {"openai_text": " Red, blue", "grpc_tokens": [1, 2, 3]}
    assert image.smoke_differences(inside, dict(inside)) == []
    problems = image.smoke_differences(inside, {"openai_text": " Red, green", "grpc_tokens": [1, 2, 3]})
    assert len(problems) == 1 and problems[0].startswith("openai_text: container ' Red, blue'")


def test_first_difference_and_counters():
    assert image_stack.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert image_stack.first_difference([1, 2], [1, 2, 3]) == 2
    metrics = (
        '# TYPE specdec_requests_total counter\nspecdec_requests_total{finish_reason="length"} 16.0\n'
        'specdec_requests_total{finish_reason="stop"} 2.0\nspecdec_requests_created 1.7e9\n'
    )
    assert image_stack.counter(metrics, "specdec_requests_total") == 18.0
    assert image_stack.counter(metrics, "specdec_absent_total") == 0.0


def fake_secret() -> dict:
    values = {
        "api-keys": "# KEY [NAME]\nsk-abcdefghijklmnopqrstuvwxyz0123 default\n",
        "auth-token": "token-0123456789",
        "redis-password": "pw-0123456789",
        "redis-replica-password": "replica-pw-0123456789",
        "ca.crt": "CA",
        "tls.crt": "CRT",
        "tls.key": "KEY",
    }
    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}}


@pytest.fixture(scope="module")
def dev_objects():
    return image_stack.render()


def test_the_dev_overlays_replicas_run_locally_with_their_manifest_settings(dev_objects, tmp_path):
    """What `make image-stack` derives from the real manifests: every $(VAR) resolved from the
    ConfigMap, the pod env and the Secret; the secrets as files; loopback addresses only."""
    secrets = image_stack.secrets_dir(tmp_path / "secrets", fake_secret())
    assert (tmp_path / "secrets" / "tls.key").read_text() == "KEY"
    assert image_stack.first_api_key(secrets["api-keys"]) == "sk-abcdefghijklmnopqrstuvwxyz0123"
    configmap = image_stack.find(dev_objects, "ConfigMap", "specdec-config")["data"]
    configmaps = {"specdec-config": {**configmap, "REDIS_URL": "redis://127.0.0.1:7000/0"}}
    for kind, name in (("StatefulSet", "specdec-target"), ("Deployment", "specdec-draft")):
        container = image_stack.main_container(image_stack.find(dev_objects, kind, name))
        env = image_stack.container_env(container, configmaps, secrets, "127.0.0.1")
        # the registry's ACL user's password, not the coordinator's (deploy/base/redis.yaml)
        assert env["REDIS_PASSWORD"] == "replica-pw-0123456789" and env["POD_IP"] == "127.0.0.1"
        assert env["REDIS_USERNAME"] == "specdec-replica"
        # only the files the pod's secret volume lists: no API keys in a replica container
        files = image_stack.pod_secrets_dir(
            tmp_path / f"secrets-{name}", image_stack.find(dev_objects, kind, name), secrets
        )
        assert sorted(p.name for p in files.iterdir()) == ["auth-token", "ca.crt", "tls.crt", "tls.key"]
        assert (files / "tls.key").read_text() == "KEY"
        assert env["SPECDEC_TLS_CERT"].startswith("/etc/specdec/")  # mutual TLS on, from the ConfigMap
        args = [image_stack.expand(a, env) for a in container["args"]]
        assert not [a for a in args if "$(" in a], args
        assert "redis://127.0.0.1:7000/0" in args
        flags = {"--host": "127.0.0.1", "--port": "1", "--advertise": "127.0.0.1:1", "--metrics-port": "2"}
        args = image_stack.with_flags(args, {**flags, "--health-port": "3"})
        assert "0.0.0.0" not in args and args[args.index("--advertise") + 1] == "127.0.0.1:1"
    with pytest.raises(image.ImageError, match="Deployment specdec-nothing"):
        image_stack.find(dev_objects, "Deployment", "specdec-nothing")


def test_the_coordinator_runs_as_kuberay_starts_the_rayservice_head_and_its_serve_config(dev_objects):
    """The head container as KubeRay writes it (tools/kuberay.py), every port it opens moved to a
    free local one, loopback only; its env with KubeRay's additions and the token; serveConfigV2
    on the moved Serve ports."""
    import json
    import shlex

    import kuberay

    service = image_stack.find(dev_objects, "RayService", "specdec-coordinator")
    ports = image_stack.head_ports(service)
    assert {6379, 8265, 52365, 10001, 8080, 9000, 8000} == set(ports)  # what the head opens, Serve's included
    assert len(set(ports.values())) == len(ports)
    overrides = image_stack.head_overrides(service, ports)
    command = kuberay.head_command(service, overrides)
    assert command[:3] == ["/bin/bash", "-c", "--"]
    ulimit, start = command[3].split("; ", 1)
    assert ulimit.startswith("ulimit -n ")
    argv = shlex.split(start)
    assert argv[:4] == ["ray", "start", "--head", "--block"]
    assert f"--port={ports[6379]}" in argv and f"--dashboard-port={ports[8265]}" in argv
    assert f"--dashboard-agent-listen-port={ports[52365]}" in argv and "--dashboard-host=127.0.0.1" in argv
    assert "--num-cpus=2" in argv and f"--memory={4 << 30}" in argv  # rayStartParams, and the limit
    params = kuberay.head_start_params(service, overrides)
    env = kuberay.head_env(service, {"HOME": "/tmp"}, params, "t0ken")
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "t0ken"  # authOptions: token
    assert env["RAY_ADDRESS"] == f"127.0.0.1:{ports[6379]}" and env["HOME"] == "/tmp"
    config = json.loads(kuberay.serve_config_json(service, ports[9000], "127.0.0.1", ports[8000]))
    assert config["grpc_options"]["port"] == ports[9000]
    assert config["http_options"] == {"host": "127.0.0.1", "port": ports[8000]}
    (app,) = config["applications"]
    assert app["import_path"] == "coordinator.serve_app:build_app"
    redis = image_stack.main_container(image_stack.find(dev_objects, "StatefulSet", "specdec-redis"))
    assert redis["args"][0] == "redis-server" and "--dir" in redis["args"]  # what the stack replaces
