"""The documents say only what is true: every fenced code block in README.md and docs/*.md is
checked by a test or marked as needing what the test machine lacks, and the README stays a
short front door whose layout table names every top-level folder.

How a block is treated:
- Marked: the line before it is `<!-- not run: REASON -->`, REASON one of `REASONS`. Nothing
  in it runs, but its `pdserve` and `make` lines are still checked as below.
- ```python in the README's client-library section: run as printed against a real cluster by
  tests/cluster/test_client_library.py. Any other ```python block runs here.
- ```sh in the walkthrough sections of docs/operations.md: run as printed, servers, curl and
  all, by tests/cluster/test_docs_walkthroughs.py; here only their `pdserve` lines are parsed.
- Any other shell block (```sh): every command line must be a `pdserve` command, parsed by
  the parser that would parse it (the CLI's, or for `pdserve bench NAME` that benchmark's
  own, since the CLI hands it the rest of the line), or `make TARGET` with a target the
  Makefile has; `echo` and `printf` may feed a pdserve command through a pipe. The cheap
  ones run: `--help` and `pdserve models list`.
- Any other language (a diagram, an output sample) must be marked.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What the test machine lacks; it has root, etcd and the default model, so a block that needs
# only those runs (tests/cluster/test_docs_walkthroughs.py).
REASONS = ("a picture", "needs a GPU", "needs docker", "needs kubernetes", "needs vLLM")
SHELL = ("sh", "bash", "shell")
FEEDERS = ("echo", "printf")  # may pipe into a pdserve command
SEPARATORS = {"|", "||", "&&", ";", "&"}
README_MAX_LINES = 200
CLIENT_SECTION = "## From Python: the client library"  # tests/cluster/test_client_library.py
OPERATIONS = ROOT / "docs" / "operations.md"
WALKTHROUGH_SECTIONS = ("## OpenAI API", "## Scaling out", "## Authentication")  # of OPERATIONS


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    section: str  # the last `## ` heading above it
    not_run: str | None  # the marker's reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line.strip()
        fence = re.match(r"^```(\S*)\s*$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = re.fullmatch(r"<!--\s*not run:\s*(.*?)\s*-->", before)
            found.append(Block(path, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                               section, marker.group(1) if marker else None))
            i = end
        i += 1
    return found


BLOCKS = [b for path in DOCS for b in blocks_of(path)]


def commands(body: str) -> list[list[list[str]]]:
    """Each command line (continuations joined, comments dropped) as its pipeline's
    segments, each a list of words."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        if not words:
            continue
        segments = [[]]
        for word in words:
            if word in SEPARATORS:
                segments.append([])
            else:
                segments[-1].append(word)
        out.append([s for s in segments if s])
    return out


def program(segment: list[str]) -> tuple[str, list[str]]:
    """The program a segment runs (`pdserve` for `.venv/bin/pdserve`) and its arguments,
    after any `NAME=value` environment assignments."""
    words = list(segment)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    if not words:
        return "", []
    return Path(words[0]).name, words[1:]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


def parse_pdserve(argv: list[str]) -> None:
    """Parse `pdserve ARGV` as the real command would; argparse exits on a bad flag."""
    from pdserve.cli import BENCHMARKS, build_parser

    if argv[:1] == ["up"] and "--" in argv:  # what follows `--` goes to both workers
        workers = argv[argv.index("--") + 1:]
        build_parser().parse_args(["prefill", *workers])
        build_parser().parse_args(["decode", *workers])
    if argv[:1] != ["bench"] or len(argv) < 2:
        build_parser().parse_args(argv)
        return
    name = argv[1]
    assert name in BENCHMARKS, f"`pdserve bench {name}`: no such benchmark ({sorted(BENCHMARKS)})"
    module = import_module(BENCHMARKS[name])
    if hasattr(module, "__path__"):  # a package: `python -m` runs its __main__, which runs cli
        module = import_module(BENCHMARKS[name] + ".cli")
    if hasattr(module, "build_parser"):
        module.build_parser().parse_args(argv[2:])
    else:
        module._parse(argv[2:])


def check_pdserve(argv: list[str], where: str) -> None:
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
            parse_pdserve(argv)
    except SystemExit as stop:
        if stop.code not in (0, None):
            pytest.fail(f"{where}: `pdserve {shlex.join(argv)}` does not parse:\n{out.getvalue()}")


def is_cheap(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv or argv == ["models", "list"]


def run_pdserve(argv: list[str], where: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{where}: `pdserve {shlex.join(argv)}` failed:\n{done.stderr}"


def python_env() -> dict[str, str]:
    """This interpreter's bin directory first, so a block's `pdserve` is this checkout's."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def client_examples() -> list[str]:
    from tests.cluster.test_client_library import SECTION, readme_examples

    assert SECTION == CLIENT_SECTION
    return readme_examples()


def is_client_example(block: Block) -> bool:
    return block.path.name == "README.md" and block.section == CLIENT_SECTION \
        and block.lang == "python"


def walkthroughs() -> list[str]:
    from tests.cluster.test_docs_walkthroughs import DOC, SECTIONS
    from tests.cluster.test_docs_walkthroughs import walkthroughs as run_there

    assert (DOC, SECTIONS) == (OPERATIONS, WALKTHROUGH_SECTIONS)
    return run_there()


def is_walkthrough(block: Block) -> bool:
    return block.path == OPERATIONS and block.section in WALKTHROUGH_SECTIONS \
        and block.lang in SHELL


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_code_block_is_checked_or_marked(block):
    if block.not_run is not None:
        assert block.not_run in REASONS, \
            f"{block.where}: 'not run: {block.not_run}' names none of {REASONS}"
    if block.lang in SHELL:
        targets = makefile_targets()
        for line in commands(block.body):
            names = [program(s)[0] for s in line]
            checked = False
            for segment in line:
                name, args = program(segment)
                if name == "pdserve":
                    check_pdserve(args, block.where)
                    if block.not_run is None and is_cheap(args):
                        run_pdserve(args, block.where)
                    checked = True
                elif name == "make":
                    missing = [t for t in args if not t.startswith("-") and t not in targets]
                    assert not missing, f"{block.where}: no Makefile target {missing}"
                    checked = True
            if block.not_run is None and not is_walkthrough(block):
                assert checked and all(n in ("pdserve", "make", *FEEDERS) for n in names), \
                    f"{block.where}: `{' '.join(sum(line, []))}` is neither checked here nor " \
                    "in a block marked <!-- not run: REASON -->"
    elif block.lang in ("python", "py"):
        if block.not_run is not None or is_client_example(block):
            return
        done = subprocess.run([sys.executable, "-c", block.body], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=python_env())
        assert done.returncode == 0, f"{block.where} failed:\n{done.stderr}"
    else:
        assert block.not_run is not None, \
            f"{block.where}: a ```{block.lang or '(no language)'} block runs nowhere; mark it " \
            "<!-- not run: a picture --> (or another reason)"


def test_the_client_examples_are_the_ones_the_cluster_test_runs():
    mine = [b.body for b in BLOCKS if is_client_example(b)]
    assert len(mine) == 2 and mine == client_examples()


def test_the_walkthroughs_are_the_ones_the_cluster_test_runs():
    mine = [b.body for b in BLOCKS if is_walkthrough(b)]
    assert len(mine) == len(WALKTHROUGH_SECTIONS) and mine == walkthroughs()
    assert not any(b.not_run for b in BLOCKS if is_walkthrough(b))


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    first = BLOCKS[0]
    assert first.path.name == "README.md" and first.lang == "sh"
    assert [program(line[0]) for line in commands(first.body)][:2] == \
        [("make", ["serve"]), ("make", ["test"])]


def top_level_folders() -> set[str]:
    try:
        files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return {f.split("/")[0] for f in files.splitlines() if "/" in f}


def test_the_layout_table_names_every_top_level_folder_and_its_module():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([^`/]+)/` \| (`[^`]+`|not installed) \|", section, re.M)
    assert {folder for folder, _ in rows} == top_level_folders()

    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    installed = {folder: name.strip("`") for folder, name in rows if name != "not installed"}
    assert installed == {folder: module for module, folder in package_dir.items()}


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_leads_somewhere(path):
    text = path.read_text()
    for target, fragment in re.findall(r"\]\((?!https?://)([^)#\s]*)(?:#([^)\s]+))?\)", text):
        dest = (path.parent / target).resolve() if target else path
        assert dest.exists(), f"{path.name}: link to {target}, which does not exist"
        if fragment:
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert fragment in {anchor(h) for h in headings}, \
                f"{path.name}: no heading #{fragment} in {dest.name}"
