"""Rules of the tree that no single package's tests see: short source files, and every
package saying what it owns. (Import direction is `lint-imports`' job; `make test` runs it.)"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["proto", "models", "engine", "kvtransfer", "runtime", "prefill", "decode", "router",
            "worker", "pdserve", "benchmarks"]
MAX_LINES = 350


def source_files():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:  # generated stubs
                yield path


def test_no_source_file_is_over_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files: {long}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_what_it_owns(package):
    import ast

    init = ROOT / package / "__init__.py"
    assert init.exists(), f"{package}/__init__.py is missing"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{package}/__init__.py has no docstring"
