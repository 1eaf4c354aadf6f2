"""Runs deploy/docker-compose.yml's services as local processes, wired the way compose
wires the containers. There is no Docker engine here, so this is the next best proof that
the file's commands, environment, volumes, discovery targets and health checks fit.

The mapping from containers to local processes:
- `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:+alt}`, `${VAR:?error}` are
  interpolated from `variables` as compose would from the shell or `.env`.
- The pdserve services are those built from deploy/Dockerfile; others (Prometheus) are
  not run. Each container port a node serves (its PDSERVE_PORT, PDSERVE_HTTP_PORT and
  PDSERVE_METRICS_PORT) becomes a free port on 127.0.0.1, and every `SERVICE:PORT` in its
  environment or command (including inside `dns:///SERVICE:PORT`) is rewritten to
  `127.0.0.1:FREEPORT`: the service name resolves to the loopback address, as compose's
  DNS resolves it to the container.
- A volume `SRC:TARGET` is a path mapping: values that start with TARGET start with SRC
  instead (a named volume becomes a fresh directory). So is a secret a service lists:
  `/run/secrets/NAME` (or its `target`) maps to the file of the top-level secret NAME,
  relative to the compose file's directory as compose reads it.
- The image's ENTRYPOINT `pdserve` is `python -m pdserve.cli`, and its `PDSERVE_*`
  variables (the Dockerfile's ENV) are each service's, under the service's own
  `environment`. `image_dirs` maps directories the image holds (its PDSERVE_CACHE, with the
  model converted and the C kernels compiled at build time: `run_kernel_step`) to local
  directories standing in for them. The image has no C compiler, and neither has a
  service here: its PATH is the virtualenv's bin alone (the image's PATH starts with its
  virtualenv) and CC is unset.
- Nothing is downloaded: pip has no index (PIP_NO_INDEX) and Hugging Face is offline, so a
  service that would fetch its model at start fails instead, as the files promise it won't.
- Services start in `depends_on` order; `condition: service_healthy` waits until the
  dependency's own healthcheck command succeeds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pdserve.procs import NodeProcess, free_port, stop_all

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
VENV_BIN = str(Path(sys.executable).parent)  # `python`, as the image's PATH finds it
KERNEL_COMMAND = "python -m pdserve.engine.native"  # compiles every C kernel into the cache

# The variables that set the ports a node listens on (the flags --port, --http-port and
# --metrics-port).
PORT_VARIABLES = ("PDSERVE_PORT", "PDSERVE_HTTP_PORT", "PDSERVE_METRICS_PORT")

_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-+?])([^}]*))?\}|\$(\w+)")


def interpolate(value, variables: dict[str, str]):
    """Compose's variable substitution over every string of a parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        present = name in variables
        nonempty = bool(variables.get(name))
        if op == ":-":
            return variables[name] if nonempty else arg
        if op == "-":
            return variables[name] if present else arg
        if op == ":+":
            return arg if nonempty else ""
        if op == "+":
            return arg if present else ""
        if op in (":?", "?") and not (nonempty if op == ":?" else present):
            raise ValueError(f"required variable {name}: {arg}")
        return variables.get(name, "")

    return _VAR.sub(sub, value)


def load_compose(variables: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), variables)


def nodes(compose: dict) -> dict[str, dict]:
    """The services that run the pdserve image (built from deploy/Dockerfile)."""
    return {name: spec for name, spec in compose["services"].items()
            if spec.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}


def served_ports(spec: dict) -> dict[str, int]:
    """The container ports a node's environment makes it listen on, by variable."""
    return {v: int(spec["environment"][v]) for v in PORT_VARIABLES if v in spec["environment"]}


def dockerfile_steps() -> list[tuple[str, str]]:
    """(instruction, argument text) of every Dockerfile instruction in order, continuations
    joined, comments left out."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    words = [line.split(None, 1) for line in text.splitlines()]
    return [(w[0], w[1] if len(w) > 1 else "") for w in words
            if w and not w[0].startswith("#")]


def dockerfile_instruction(name: str) -> str:
    """The argument text of the Dockerfile's last NAME instruction."""
    found = [text for instruction, text in dockerfile_steps() if instruction == name]
    assert found, f"no {name} in {DOCKERFILE}"
    return found[-1]


def kernel_step() -> int:
    """The index in dockerfile_steps() of the RUN step that compiles the C kernels."""
    found = [i for i, (instruction, text) in enumerate(dockerfile_steps())
             if instruction == "RUN" and KERNEL_COMMAND in text]
    assert len(found) == 1, f"{len(found)} RUN steps run {KERNEL_COMMAND!r} in {DOCKERFILE}"
    return found[0]


def run_kernel_step(cache: Path) -> subprocess.CompletedProcess:
    """The Dockerfile's kernel step, its shell command as written, run here as the build
    runs it: `python` is the virtualenv's, and the image's PDSERVE_CACHE is `cache`."""
    text = dockerfile_steps()[kernel_step()][1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env = {**base, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "PDSERVE_CACHE": str(cache)}
    return subprocess.run(["/bin/sh", "-c", text], cwd=cache, env=env, capture_output=True,
                          text=True, timeout=600)


def image_environment(until: int | None = None) -> dict[str, str]:
    """The `PDSERVE_*` variables the CPU image's ENV instructions set (those before step
    `until` of dockerfile_steps(), or all)."""
    env = {}
    stage = ""
    for instruction, text in dockerfile_steps()[:until]:
        if instruction == "FROM":
            stage = text.split()[-1]
        # The image built here is the CPU variant: the CUDA base stage's ENV is not in it.
        if instruction == "ENV" and stage != "base-cuda":
            pairs = [word.split("=", 1) for word in shlex.split(text)]
            assert all(len(p) == 2 for p in pairs), f"ENV without KEY=VALUE: {text}"
            env.update((k, v) for k, v in pairs if k.startswith("PDSERVE_"))
    return env


def entrypoint() -> list[str]:
    words = json.loads(dockerfile_instruction("ENTRYPOINT"))
    assert words == ["pdserve"], f"unexpected ENTRYPOINT {words}"
    return PDSERVE


def health_command(test: list[str]) -> list[str]:
    """A compose/Dockerfile `CMD` health test as a local command line."""
    assert test[0] == "CMD" and test[1] == "pdserve", f"unexpected health test {test}"
    return [*PDSERVE, *test[2:]]


class LocalService(NodeProcess):
    def __init__(self, name: str, spec: dict, env: dict[str, str], port: int, log: Path):
        super().__init__([str(word) for word in spec.get("command", [])], log=log, env=env,
                         program=entrypoint())
        self.spec, self.env, self.port = spec, env, port
        self.address = f"127.0.0.1:{port}"

    def healthcheck(self, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run the service's compose healthcheck command, in its environment."""
        return subprocess.run(health_command(self.spec["healthcheck"]["test"]), cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)


class LocalCompose:
    """Every service of the compose file as a local process (see the module docstring)."""

    def __init__(self, variables: dict[str, str], workdir: Path,
                 image_dirs: dict[str, str] | None = None) -> None:
        self.compose = load_compose(variables)
        self.workdir = workdir
        self.image_dirs = image_dirs or {}
        self.services: dict[str, LocalService] = {}
        # service -> variable -> (container port, local port)
        self.port_map = {name: {v: (inner, free_port()) for v, inner in served_ports(spec).items()}
                         for name, spec in nodes(self.compose).items()}
        self.ports = {name: ports["PDSERVE_PORT"] for name, ports in self.port_map.items()}
        self.addresses = {f"{name}:{inner}": f"127.0.0.1:{outer}"
                          for name, ports in self.port_map.items()
                          for inner, outer in ports.values()}

    def _paths(self, spec: dict) -> dict[str, str]:
        paths = {}
        for volume in spec.get("volumes", []):
            source, target = volume.split(":")[:2]
            if not source.startswith(("/", ".")):  # a named volume
                source = str(self.workdir / "volumes" / source)
                Path(source).mkdir(parents=True, exist_ok=True)
            paths[target] = source
        for secret in spec.get("secrets", []):
            name = secret if isinstance(secret, str) else secret["source"]
            target = name if isinstance(secret, str) else secret.get("target", name)
            target = target if target.startswith("/") else f"/run/secrets/{target}"
            paths[target] = str(COMPOSE_FILE.parent / self.compose["secrets"][name]["file"])
        return paths

    @staticmethod
    def rewrite_paths(value: str, paths: dict[str, str]) -> str:
        for target, source in paths.items():
            if value == target or value.startswith(target + "/"):
                return source + value[len(target):]
        return value

    def rewrite(self, value: str, paths: dict[str, str]) -> str:
        for inner, outer in self.addresses.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(inner)}(?!\d)", outer, value)
        return self.rewrite_paths(value, paths)

    def environment(self, name: str) -> dict[str, str]:
        spec = self.compose["services"][name]
        paths = self._paths(spec)
        image = {k: self.rewrite_paths(v, self.image_dirs) for k, v in image_environment().items()}
        env = {k: self.rewrite(str(v), paths) for k, v in spec["environment"].items()}
        env.update((v, str(outer)) for v, (_, outer) in self.port_map[name].items())
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") and k != "CC"}
        base["PATH"] = VENV_BIN  # no cc or gcc: the image has no compiler
        offline = {"PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1"}
        return {**base, **offline, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                **image, **env}

    def local_address(self, name: str, variable: str) -> str:
        """Where node `name` serves the port `variable` sets (one of PORT_VARIABLES)."""
        return f"127.0.0.1:{self.port_map[name][variable][1]}"

    def order(self) -> list[str]:
        specs, done = nodes(self.compose), []
        while len(done) < len(specs):
            ready = [n for n, s in specs.items()
                     if n not in done and all(d in done for d in s.get("depends_on", {}))]
            assert ready, f"depends_on cycle among {set(specs) - set(done)}"
            done += ready
        return done

    def up(self, timeout_s: float = 180.0) -> None:
        specs = nodes(self.compose)
        deadline = time.monotonic() + timeout_s
        for name in self.order():
            for dep, how in specs[name].get("depends_on", {}).items():
                if how.get("condition") == "service_healthy":
                    self.wait_healthy(dep, deadline)
            self.services[name] = LocalService(name, specs[name], self.environment(name),
                                               self.ports[name][1], self.workdir / f"{name}.log")
        for name in self.services:
            self.wait_healthy(name, deadline)

    def wait_healthy(self, name: str, deadline: float) -> None:
        service = self.services[name]
        while True:
            if not service.alive():
                raise RuntimeError(f"{name} exited with {service.proc.returncode}:\n"
                                   + service.log_path.read_text()[-3000:])
            if service.healthcheck().returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy in time:\n"
                                   + service.log_path.read_text()[-3000:])
            time.sleep(0.2)  # the next health check, as compose's `interval` would

    def down(self) -> None:
        stop_all(list(self.services.values())[::-1])
