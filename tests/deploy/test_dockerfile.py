"""What the Dockerfile promises, checked without a Docker engine: the same torch as the
Makefile, a non-root user, a health check, a build context without the local clutter, and
the default model converted at build time into the cache the image's nodes read."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.models.catalogue import DEFAULT_MODEL
from tests.deploy.compose_local import (DOCKERFILE, REPO, VENV_BIN, dockerfile_instruction,
                                        dockerfile_steps, image_environment, kernel_step,
                                        load_compose, nodes, served_ports)


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


def stages() -> dict[str, tuple[str, list[tuple[int, str, str]]]]:
    """Every stage of the Dockerfile: name -> (the stage it starts FROM, its steps as
    (index in dockerfile_steps(), instruction, text))."""
    found: dict[str, tuple[str, list]] = {}
    name = ""
    for i, (instruction, text) in enumerate(dockerfile_steps()):
        if instruction == "FROM":
            words = text.split()
            name = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else f"#{i}"
            found[name] = (words[0], [])
        elif name:
            found[name][1].append((i, instruction, text))
    return found


def runtime_uid() -> int:
    """The uid the Dockerfile gives its `pdserve` user."""
    runs = "\n".join(text for instruction, text in dockerfile_steps() if instruction == "RUN")
    return int(re.search(r"useradd --uid (\d+) .* pdserve$", runs, re.M).group(1))


def test_image_compiles_the_kernels_after_the_source_in_a_stage_it_leaves_behind():
    steps = dockerfile_steps()
    build = kernel_step()
    text = steps[build][1]
    assert run_step("pip install --no-deps /src") < build, "the kernels come from the source"
    user_step = max(i for i, (instruction, _) in enumerate(steps) if instruction == "USER")
    assert build < user_step
    # Into the cache the nodes read at run time, readable by any user (the compiler leaves
    # the libraries readable by their owner alone).
    assert "PDSERVE_CACHE=" not in text, "the step must use the image's PDSERVE_CACHE"
    assert image_environment(until=build)["PDSERVE_CACHE"] == image_environment()["PDSERVE_CACHE"]
    assert 'chmod -R a+rX "${PDSERVE_CACHE}/kernels"' in text
    # A stage of its own has the compiler; the CPU image is built FROM the stage before it
    # and copies only the kernels, owned by the runtime user. (The CUDA image also has gcc,
    # which Triton needs at run time.)
    all_stages = stages()
    (kernels,) = [n for n, (_, s) in all_stages.items() if build in [i for i, _, _ in s]]
    _, (variant, final_steps) = list(all_stages.items())[-1]
    assert variant == "runtime-${VARIANT}"
    compiler = [n for n, (_, s) in all_stages.items()
                if any(re.search(r"apt-get install .*\bgcc\b", t) for _, _, t in s)]
    assert compiler == [kernels, "runtime-cuda"]
    assert all_stages[kernels][0] == all_stages["runtime-cpu"][0] == all_stages["runtime-cuda"][0] != kernels
    assert all_stages["runtime-cpu"][1] == [], "the CPU image adds nothing to the install stage"
    copies = [t for _, instruction, t in final_steps if instruction == "COPY"]
    assert copies == [f"--from={kernels} --chown=pdserve:pdserve ${{PDSERVE_CACHE}}/kernels "
                      "${PDSERVE_CACHE}/kernels"]


def test_kernels_built_by_the_image_step_load_as_the_runtime_user_without_a_compiler(
        image_cache):
    """The conftest ran the step's own command into `image_cache`. A copy as the final stage
    makes it (owned by the runtime user) loads every kernel as that user (when the test
    runs as root) with no compiler on PATH, while an empty cache finds none. (That another
    CPU loads the portable half: tests/engine/test_native.py.)"""
    from pdserve.engine import native

    built = sorted(p.name for p in Path(image_cache, "kernels").iterdir())
    assert len(built) == 2 * len(native.WRAPPERS), built  # for this CPU, and portable
    for path in Path(image_cache, "kernels").iterdir():
        assert path.stat().st_mode & 0o444 == 0o444, f"{path} is not readable by every user"
    uid = runtime_uid()
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        image, empty = Path(d, "image"), Path(d, "empty")
        shutil.copytree(Path(image_cache, "kernels"), image / "kernels")  # COPY keeps modes
        empty.mkdir()
        if os.geteuid() == 0:
            for path in [image, image / "kernels", *(image / "kernels").iterdir()]:
                os.chown(path, uid, uid)
        code = ("from pdserve.engine import native; s = native.build_all(); "
                "print(s.state, s.reason)")
        setpriv = shutil.which("setpriv")  # util-linux
        as_user = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] \
            if os.geteuid() == 0 and setpriv else []
        answers = {}
        for name, cache in (("image", image), ("empty", empty)):
            env = {"PATH": VENV_BIN, "PDSERVE_CACHE": str(cache), "HOME": str(cache)}
            result = subprocess.run([*as_user, sys.executable, "-c", code], cwd=d, env=env,
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr
            answers[name] = result.stdout.split()
    assert answers == {"image": ["c"], "empty": ["torch", "no_compiler"]}


def test_cuda_variant_runs_every_worker_on_the_gpu(monkeypatch):
    from pdserve.cli import build_parser

    (cuda_env,) = [t for _, i, t in stages()["base-cuda"][1] if i == "ENV"]
    env = dict(word.split("=", 1) for word in shlex.split(cuda_env))
    assert env["PDSERVE_DEVICE"] == "cuda"
    monkeypatch.setenv("PDSERVE_DEVICE", env["PDSERVE_DEVICE"])
    for role in ("prefill", "decode", "serve"):
        assert build_parser().parse_args([role]).device == "cuda", role
    assert "PDSERVE_DEVICE" not in image_environment(), "the CPU image keeps the CPU default"


def test_image_exposes_every_port_the_compose_nodes_serve():
    exposed = {int(p) for p in dockerfile_instruction("EXPOSE").split()}
    for name, spec in nodes(load_compose({})).items():
        assert set(served_ports(spec).values()) <= exposed, name


def test_the_cuda_image_has_what_triton_builds_its_launchers_with():
    # Triton compiles each kernel's launcher with a C compiler and Python's headers the first
    # time the kernel runs on a machine: without them a GPU worker dies at start-up.
    (install,) = [t for _, i, t in stages()["runtime-cuda"][1] if i == "RUN"]
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"apt-get install .*\b{package}\b", install), package
