"""What the Dockerfile promises, checked without a Docker engine: the same torch as the
Makefile, a non-root user, a health check, a build context without the local clutter."""

from __future__ import annotations

import re

from tests.deploy.compose_local import DOCKERFILE, REPO, dockerfile_instruction


def test_image_pins_the_torch_the_makefile_installs():
    makefile = re.search(r"torch==([\w.+]+)", (REPO / "Makefile").read_text()).group(1)
    assert f"ARG TORCH_VERSION={makefile}" in DOCKERFILE.read_text()


def test_image_runs_as_a_plain_user_with_a_health_check():
    assert dockerfile_instruction("USER") not in ("root", "0")
    assert "CMD" in dockerfile_instruction("HEALTHCHECK")


def test_cpu_is_the_default_and_cuda_a_build_argument():
    text = DOCKERFILE.read_text()
    assert "ARG VARIANT=cpu" in text
    assert "FROM python:3.11-slim AS base-cpu" in text
    assert re.search(r"FROM \$\{CUDA_BASE\} AS base-cuda", text)
    assert "FROM base-${VARIANT}" in text
    assert "whl/cpu" in text and "whl/cu" in text


def test_build_context_leaves_out_the_virtualenv_and_git():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
