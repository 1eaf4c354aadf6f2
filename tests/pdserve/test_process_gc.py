"""The garbage collector in pdserve's own programs (pdserve/process_gc.py): a server starts
with it off and, once it serves, freezes what start-up made and turns it on, and hands the
memory that start-up freed back to the system; every program freezes all at exit; a
program that only imports pdserve keeps its collector as it was."""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import subprocess
import sys
import weakref
from importlib.metadata import entry_points

import pytest

from pdserve import cli, process_gc


@pytest.fixture
def collector(monkeypatch):
    """This process's collector, put back as it was after the test."""
    monkeypatch.setattr(process_gc, "_own", False)
    was_enabled = gc.isenabled()
    yield
    atexit.unregister(gc.freeze)
    gc.unfreeze()
    (gc.enable if was_enabled else gc.disable)()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_server_starts_with_the_collector_off_and_freezes_its_start_up_once_serving(collector):
    process_gc.own_process(server=True)
    assert not gc.isenabled()
    garbage = weakref.ref(_Cycle())  # start-up's garbage: collected, not kept frozen
    kept = _Cycle()
    process_gc.serving()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert garbage() is None and kept.me is kept


def test_a_node_turns_the_collector_on_once_it_serves_before_its_ready_line(collector, capsys):
    from pdserve.runtime.server import new_server, serve

    process_gc.own_process(server=True)
    stop, during_start = asyncio.Event(), []

    async def on_start(port: int) -> None:  # the last step of its start
        during_start.append(gc.isenabled())
        stop.set()  # and it stops as soon as it has served

    async def node() -> None:
        await serve(new_server(), role="test", host="127.0.0.1", port=0, service_names=[],
                    on_start=on_start, stop=stop, grace_s=0)

    asyncio.run(node())
    assert during_start == [False]
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert "pdserve test listening on 127.0.0.1:" in capsys.readouterr().out


# In a fresh process, whose heap holds nothing else: 256 blocks of 1 MiB freed between small
# ones still held, so glibc's heap cannot shrink from its top.
FREE_AMID_HELD = """
import json
import torch
from pdserve import process_gc
process_gc.own_process(server=True)

def anon():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))

torch.ones(8 << 20, dtype=torch.uint8)  # mapped and unmapped at once: glibc takes smaller blocks from its heap since
blocks, held = [], []
for _ in range(256):
    blocks.append(torch.ones(1 << 20, dtype=torch.uint8))
    held.append(torch.ones(64, dtype=torch.uint8))
del blocks
freed = anon()
process_gc.serving()
print(json.dumps({"handed_back": freed - anon()}))
"""


def test_a_server_hands_back_the_memory_start_up_freed_once_serving():
    out = subprocess.run([sys.executable, "-c", FREE_AMID_HELD], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    handed_back = json.loads(out.stdout)["handed_back"]
    assert handed_back > 200 << 20, f"handed back {handed_back >> 20} MiB of the 256 MiB freed"


def test_a_program_that_only_imports_pdserve_keeps_its_collector(collector):
    gc.enable()
    process_gc.serving()  # a server run in a caller's process (the tests run some)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_every_program_freezes_all_at_exit_after_its_own_exit_handlers():
    # Exit handlers run last registered first: the program's own, registered after
    # own_process(), see the collector as it was; one registered before it sees the freeze.
    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('last', gc.get_freeze_count() > 0))\n"
            "from pdserve import process_gc\n"
            "process_gc.own_process()\n"
            "atexit.register(lambda: print('first', gc.get_freeze_count() == 0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.splitlines() == ["first True", "last True"]


@pytest.mark.parametrize("argv, server", [(["decode", "--model", "gpt-17"], True),
                                          (["router", "--model", "gpt-17", "--decode", "127.0.0.1:1"], True),
                                          (["models", "path", "gpt-17"], False)])
def test_the_pdserve_program_owns_its_process_and_says_whether_it_serves(argv, server, monkeypatch):
    """(Each command ends at once: the model is unknown.)"""
    calls = []
    monkeypatch.setattr(process_gc, "own_process", lambda server=False: calls.append(server))

    def run(**program) -> None:
        with pytest.raises(SystemExit):
            sys.exit(cli.main(argv, **program))

    run(program=True)
    assert calls == [server]
    run()  # a caller's process: nothing changes
    assert calls == [server]


def test_the_pdserve_command_is_the_program():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "pdserve"]
    assert script.value == "pdserve.cli:run"
