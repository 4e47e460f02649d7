"""The Dockerfile the GPUStack backend's image comes from: it parses, builds the image the YAML names, keeps its
caches on a volume, checks its health, and its command runs (``dsinfer serve --help`` here, on the CPU)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    parsed = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            parsed.append((keyword.upper(), arguments.strip()))
    return parsed


def test_dockerfile_builds_the_image_the_gpustack_yaml_names():
    dockerfile = (ROOT / "Dockerfile").read_text()
    steps = instructions(dockerfile)
    keywords = [keyword for keyword, _ in steps]
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "VOLUME", "EXPOSE", "HEALTHCHECK", "CMD", "ENTRYPOINT"}
    assert set(keywords) <= known, set(keywords) - known
    assert keywords.index("FROM") < keywords.index("RUN")
    args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in steps if k == "ARG" and "=" in a}
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    torch_version, triton_version = args["TORCH_VERSION"], args["TRITON_VERSION"]
    assert torch_version.startswith("2.1") and triton_version.startswith("3.")
    assert "/health" in dict(steps)["HEALTHCHECK"]
    assert json.loads(dict(steps)["VOLUME"]) == ["/cache"]
    assert "TRITON_CACHE_DIR=/cache/triton" in dict(steps)["ENV"]
    backend = yaml.safe_load((ROOT / "deploy/gpustack/dsinfer-backend.yaml").read_text())
    image = backend["version_configs"][backend["default_version"]]["image_name"]
    assert f"docker build -t {image} ." in dockerfile  # the documented build makes the image the YAML names
    assert f"docker build -t {image} ." in (ROOT / "deploy/gpustack/dsinfer-backend.yaml").read_text()


def test_the_image_command_runs():
    command = json.loads(dict(instructions((ROOT / "Dockerfile").read_text()))["CMD"])
    assert command[:2] == ["dsinfer", "serve"]
    run = subprocess.run([sys.executable, "-m", "dsinfer.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    for flag in command[2:]:
        if flag.startswith("--"):
            assert flag in run.stdout, flag
    yaml_command = yaml.safe_load((ROOT / "deploy/gpustack/dsinfer-backend.yaml").read_text())["default_run_command"]
    for flag in shlex.split(yaml_command):
        if flag.startswith("--"):
            assert flag in run.stdout, flag
