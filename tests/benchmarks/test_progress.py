"""`bench serve`'s progress: plain lines at each tenth of a run where stderr is no terminal,
a tqdm bar where it is one, and failures counted as they come."""

import io

from pdserve.benchmarks.serve.progress import RunProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_it_prints_a_line_at_each_tenth_of_the_run():
    out = io.StringIO()
    progress = RunProgress(20, "bench serve @ 2 req/s", out)
    for i in range(20):
        progress.add(ok=i not in (3, 4, 11))
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "bench serve @ 2 req/s: 20 requests"
    assert [line.split(": ")[1].split(",")[:2] for line in lines[1:]] == [
        [f"{done}/20 done", f" {failed} failed"]
        for done, failed in zip(range(2, 21, 2), (0, 1, 2, 2, 2, 3, 3, 3, 3, 3))]
    assert lines[-1].endswith(" s")


def test_a_short_run_prints_a_line_per_request_and_none_twice():
    out = io.StringIO()
    progress = RunProgress(3, "run", out)
    for _ in range(3):
        progress.add(ok=True)
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == [
        "run: 3 requests", "run: 1/3 done", "run: 2/3 done", "run: 3/3 done"]


def test_on_a_terminal_it_draws_a_bar_that_counts_failures():
    out = Terminal()
    progress = RunProgress(4, "run", out)
    for ok in (True, False, True, True):
        progress.add(ok)
    bar = progress.bar
    assert (bar.n, bar.total, bar.postfix) == (4, 4, "failed=1")
    progress.close()
    assert "run:" in out.getvalue() and "requests" not in out.getvalue()  # a bar, no lines
