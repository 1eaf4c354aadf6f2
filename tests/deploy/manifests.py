"""Reading deploy/k8s/: every YAML document of every manifest file."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S_DIR.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def containers() -> list[tuple[str, dict]]:
    """(component, container) of every Deployment."""
    return [(d["metadata"]["labels"]["app.kubernetes.io/component"], c)
            for d in by_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]]
