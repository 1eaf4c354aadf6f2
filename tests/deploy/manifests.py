"""Reading deploy/k8s/: every YAML document of every manifest file, the optional ones in
its subdirectories included (kustomization.yaml lists only the top level), and not
kustomization.yaml itself (kustomize's, not a Kubernetes object)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"

# A commented-out YAML line: `# key:`, `# key: value` or `# - key: value` (prose comments
# never start with a bare key and a colon).
_COMMENTED_YAML = re.compile(r"^(\s*)# (\s*(?:- )?\w+:(?: |$).*)$")


def documents(top_level_only: bool = False) -> list[tuple[Path, dict]]:
    paths = K8S_DIR.glob("*.yaml") if top_level_only else K8S_DIR.rglob("*.yaml")
    return [(path, doc) for path in sorted(paths) if path != KUSTOMIZATION
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def containers(docs: list[dict] | None = None) -> list[tuple[str, dict]]:
    """(component, container) of every Deployment."""
    docs = by_kind("Deployment") if docs is None else docs
    return [(d["metadata"]["labels"]["app.kubernetes.io/component"], c)
            for d in docs if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]]


def uncommented(path: Path) -> list[dict]:
    """The documents of `path` with its commented-out YAML lines put back: what a user who
    follows the comments' instructions ("uncomment ...") applies."""
    text = "\n".join(_COMMENTED_YAML.sub(r"\1\2", line)
                     for line in path.read_text().splitlines())
    return [doc for doc in yaml.safe_load_all(text) if doc]
