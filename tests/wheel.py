"""pdserve as a user installs it: the wheel `pip` builds from this checkout, and a site
directory holding that wheel plus only what its plain install requires (the client), copied
from this venv so the tests run offline. A Python started with `-I -S` and this directory on
its path sees nothing else: no torch, no NIXL, no Triton."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(dest: Path) -> Path:
    """`pip wheel .` without its dependencies: the file a `pip install .` would unpack."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dest), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = dest.glob("pdserve-*.whl")
    return wheel


def plain_requirements(wheel: Path) -> list[Requirement]:
    """What `pip install pdserve` pulls in: the wheel's Requires-Dist outside any extra."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        fields = Parser().parsestr(z.read(name).decode())
    reqs = [Requirement(line) for line in fields.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def closure(reqs: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions these requirements need, transitively (this venv's)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = metadata.distribution(req.name)
        seen[key] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return list(seen.values())


def light_site(wheel: Path, dest: Path) -> Path:
    """The wheel unpacked into `dest` beside copies of its plain requirements' files."""
    for dist in closure(plain_requirements(wheel)):
        for file in dist.files or []:
            if file.parts[0] == ".." or file.suffix == ".pyc":  # scripts in bin/, caches
                continue
            target = dest / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist.locate_file(file), target)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest


def run_isolated(site: Path, code: str, cwd: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`code` in a Python that sees the standard library and `site` only."""
    prelude = f"import sys; sys.path.insert(0, {str(site)!r})\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", prelude + code], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout_s)
