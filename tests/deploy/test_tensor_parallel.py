"""Tensor parallelism in the deployment files: the prefill and decode containers each get
their own --tensor-parallel-size (compose: PREFILL_TP and DECODE_TP, default 1; Kubernetes:
each Deployment's PDSERVE_TENSOR_PARALLEL_SIZE), read as the container's `pdserve` reads
it; the router gets none."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from tests.deploy.compose_local import load_compose, nodes
from tests.deploy.manifests import containers

VARIABLE = "PDSERVE_TENSOR_PARALLEL_SIZE"


def parsed_size(command: list, env: dict[str, str], monkeypatch) -> int:
    """The --tensor-parallel-size of `command` run with `env`, as the container parses it."""
    for key in (k for k in env if k.startswith("PDSERVE_")):
        monkeypatch.setenv(key, str(env[key]))
    return build_parser().parse_args([str(word) for word in command]).tensor_parallel_size


@pytest.mark.parametrize("variables,sizes", [({}, (1, 1)), ({"PREFILL_TP": "2"}, (2, 1)),
                                             ({"DECODE_TP": "3"}, (1, 3))])
def test_compose_gives_prefill_and_decode_their_own_tensor_parallel_size(variables, sizes,
                                                                        monkeypatch):
    services = nodes(load_compose(variables))
    assert VARIABLE not in services["router"]["environment"]
    for role, size in zip(("prefill", "decode"), sizes):
        with monkeypatch.context() as m:
            m.delenv(VARIABLE, raising=False)
            spec = services[role]
            assert parsed_size(spec["command"], spec["environment"], m) == size, role


def test_kubernetes_workers_set_their_tensor_parallel_size(monkeypatch):
    sized = {component: container for component, container in containers()
             if VARIABLE in {e["name"] for e in container.get("env", [])}}
    assert set(sized) == {"prefill", "decode"}
    for component, container in sized.items():
        env = {e["name"]: e["value"] for e in container["env"]}
        with monkeypatch.context() as m:
            m.delenv(VARIABLE, raising=False)
            size = parsed_size(container["args"], env, m)
        assert size == 1, f"{component}: the default is one rank"
