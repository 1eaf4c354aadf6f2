"""What the Dockerfile promises, checked without a Docker engine: the same torch as the
Makefile, a non-root user, a health check, a build context without the local clutter, and
the default model converted at build time into the cache the image's nodes read."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from pdserve.models.catalogue import DEFAULT_MODEL
from tests.deploy.compose_local import (DOCKERFILE, REPO, dockerfile_instruction,
                                        dockerfile_steps, image_environment)


def run_step(words: str) -> int:
    """The index in dockerfile_steps() of the one RUN step whose text contains `words`."""
    found = [i for i, (instruction, text) in enumerate(dockerfile_steps())
             if instruction == "RUN" and words in text]
    assert len(found) == 1, f"{len(found)} RUN steps with {words!r} in {DOCKERFILE}"
    return found[0]


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


def test_image_converts_the_default_model_after_the_dependencies_from_models_alone():
    steps = dockerfile_steps()
    convert = run_step("from pdserve.models.convert import ensure")
    text = steps[convert][1]
    assert re.findall(r"ensure\('([\w.-]+)'\)", text) == [DEFAULT_MODEL]
    # torch, transformers and gguf are installed by then; the source comes after, and
    # only models/ is mounted, so a source change does not rebuild the model layer.
    assert run_step("pip install -r") < convert < run_step("pip install --no-deps /src")
    assert re.findall(r"--mount=type=bind,source=([^,\s]+)", text) == ["models"]
    # It converts into the cache the nodes read at run time.
    assert "PDSERVE_CACHE=" not in text, "the step must use the image's PDSERVE_CACHE"
    cache = image_environment(until=convert).get("PDSERVE_CACHE")
    assert cache and image_environment()["PDSERVE_CACHE"] == cache
    assert re.search(r'chown pdserve "\$\{PDSERVE_CACHE\}/models"', text)
    user_step = max(i for i, (instruction, _) in enumerate(steps) if instruction == "USER")
    assert user_step > convert and dockerfile_instruction("USER") == "pdserve"


def test_installed_command_finds_the_model_in_the_image_cache_at_build_time():
    check = run_step("pdserve models path")
    assert dockerfile_steps()[check][1].split() == ["pdserve", "models", "path", DEFAULT_MODEL]
    assert check > run_step("pip install --no-deps /src")
    assert image_environment(until=check)["PDSERVE_CACHE"] == image_environment()["PDSERVE_CACHE"]


def test_conversion_step_runs_with_only_models_on_the_path(tmp_path, image_cache):
    """The step's own command, run here as the build runs it: Python without site-packages
    (so not the editable install of the whole repo), with nothing but models/ at the
    mount's target (`pdserve/models` under a folder with no `__init__.py`: a namespace).
    With the model already in the cache it returns at once, offline."""
    text = dockerfile_steps()[run_step("from pdserve.models.convert import ensure")][1]
    target = re.search(r"source=models,target=(\S+?)/pdserve/models\b", text).group(1)
    assert f"PYTHONPATH={target} " in text, "the namespace's parent must be on PYTHONPATH"
    words = shlex.split(text.split("&&")[0])
    code = words[words.index("-c") + 1]
    (tmp_path / "src" / "pdserve").mkdir(parents=True)
    (tmp_path / "src" / "pdserve" / "models").symlink_to(REPO / "models")
    env = {"PYTHONPATH": str(tmp_path / "src"), "PDSERVE_CACHE": image_cache,
           "PIP_NO_INDEX": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
