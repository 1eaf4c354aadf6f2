"""Fixtures for the deployment tests: the image's cache, standing in for the model the
Dockerfile converts and the C kernels it compiles at build time, the key files an operator makes once (the compose
secrets), and the compose services running as local processes with their defaults (see
compose_local.py)."""

from __future__ import annotations

import json
import secrets
import shutil

import pytest

from pdserve.models.catalogue import CARD_FILE, DEFAULT_MODEL
from tests.deploy.compose_local import LocalCompose, image_environment, run_kernel_step

# Compose variables, as a user would put them in `.env`: small settings for a shared
# two-core machine. No MODEL_DIR: the services serve the image's model.
VARIABLES = {"NUM_THREADS": "1", "KV_CACHE_MB": "16"}


@pytest.fixture(scope="session")
def image_cache(tiny_model, tmp_path_factory) -> str:
    """A local stand-in for the image's PDSERVE_CACHE: the default model converted into it,
    as the Dockerfile's build step leaves it (here the tiny checkpoint under the default
    model's name and card, so nothing is downloaded), and the C kernels compiled into it by
    the Dockerfile's own kernel step."""
    cache = tmp_path_factory.mktemp("image-cache")
    converted = cache / "models" / DEFAULT_MODEL
    shutil.copytree(tiny_model, converted)
    (converted / CARD_FILE).write_text(json.dumps({"name": DEFAULT_MODEL}))
    built = run_kernel_step(cache)
    assert built.returncode == 0, built.stdout + built.stderr
    return str(cache)


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, str]:
    """The cluster key and API key, each in its own file as the compose file's comment
    says to make them, and the compose variables that point its secrets at them."""
    d = tmp_path_factory.mktemp("secrets")
    made = {"cluster": secrets.token_hex(32), "api": secrets.token_hex(32)}
    for name, value in made.items():
        (d / f"{name}-key").write_text(value + "\n")
        (d / f"{name}-key").chmod(0o400)
    return {**made, "CLUSTER_KEY_FILE": str(d / "cluster-key"), "API_KEY_FILE": str(d / "api-key")}


@pytest.fixture(scope="session")
def compose(image_cache, keys, tmp_path_factory):
    image_dirs = {image_environment()["PDSERVE_CACHE"]: image_cache}
    variables = {**VARIABLES, "CLUSTER_KEY_FILE": keys["CLUSTER_KEY_FILE"],
                 "API_KEY_FILE": keys["API_KEY_FILE"]}
    stack = LocalCompose(variables, tmp_path_factory.mktemp("compose"), image_dirs)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
