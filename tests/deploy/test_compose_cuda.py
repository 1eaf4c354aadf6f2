"""deploy/docker-compose.cuda.yml, the override for the CUDA image: valid against the
Compose Specification, it gives the prefill and decode containers the GPU and sizes
their KV pools by shares of it that fit together, and the nodes read those settings as
meant (no GPU here: the files are read, and the nodes' flags parsed from them)."""

from __future__ import annotations

import pytest
import yaml

from pdserve.cli import build_parser
from tests.deploy.compose_local import COMPOSE_FILE, interpolate, load_compose
from tests.deploy.test_schemas import check_compose

CUDA_FILE = COMPOSE_FILE.with_name("docker-compose.cuda.yml")


def merged(variables: dict[str, str]) -> dict:
    """The two files as `docker compose -f base -f cuda` merges them (mappings key by key)."""
    base, cuda = load_compose(variables), interpolate(yaml.safe_load(CUDA_FILE.read_text()), variables)
    for name, override in cuda["services"].items():
        spec = base["services"][name]
        for key, value in override.items():
            spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def test_the_cuda_override_matches_the_compose_specification():
    result = check_compose(CUDA_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variables", [{}, {"KV_CACHE_MB": "512", "DTYPE": "float32"}])
def test_workers_get_the_gpu_and_kv_shares_that_fit_together(variables, monkeypatch):
    services = merged(variables)["services"]
    fractions = []
    for role in ("prefill", "decode"):
        spec = services[role]
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        for name, value in spec["environment"].items():
            monkeypatch.setenv(name, str(value))
        args = build_parser().parse_args(spec["command"])
        assert args.kv_cache_mb is None, "a KV size in MiB would win over the GPU's fraction"
        assert args.dtype == variables.get("DTYPE", "bfloat16")
        fractions.append(args.kv_cache_memory_fraction)
        for name in spec["environment"]:
            monkeypatch.delenv(name)
    assert fractions[0] < fractions[1] and sum(fractions) <= 0.5
    assert "deploy" not in services["router"], "the router takes no GPU"
