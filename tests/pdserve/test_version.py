"""`pdserve --version` names the installed distribution's version, as pip recorded it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def test_version_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pdserve {version('pdserve')}"
