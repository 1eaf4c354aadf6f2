"""Smoke test of `pdserve bench transfer` with tiny sizes: JSON fields, plot, arithmetic, and --tp."""

import json

import numpy as np
import pytest

from pdserve.benchmarks.transfer import fragmented_pages, main


def test_bench_prints_the_json_fields_and_draws_the_plot(capsys, tmp_path):
    png = tmp_path / "bw.png"
    rc = main(["--tokens", "64", "--page-size", "4", "--dst-page-size", "8", "--dst-layout", "layer-major",
               "--layers", "2",
               "--kv-heads", "2", "--head-dim", "16", "--dtype", "float16", "--fragmentation", "0.5",
               "--repeats", "2", "--json", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("kv_gbps", "raw_nixl_gbps", "memcpy_gbps", "efficiency", "descriptors", "bytes"):
        assert key in out
    assert out["bytes"] == 64 * 2 * 2 * 2 * 16 * 2
    assert out["efficiency"] == pytest.approx(out["kv_gbps"] / out["raw_nixl_gbps"], rel=0.02)
    assert out["verified"] is True and out["descriptors"] >= 2 * 2
    assert (out["layout"], out["dst_layout"]) == ("page-major", "layer-major")  # page-major by default
    assert png.stat().st_size > 0 and len(out["sweep"]) >= 2
    assert "per_rank" not in out and "tp" not in out  # without --tp the output is as before


def test_bench_rejects_bad_options():
    with pytest.raises(SystemExit):
        main(["--fragmentation", "1.5"])
    with pytest.raises(SystemExit):
        main(["--dtype", "int4"])
    with pytest.raises(SystemExit):
        main(["--layout", "head-major"])


@pytest.mark.parametrize("fragmentation", [0.0, 0.5, 1.0])
def test_fragmentation_is_the_share_of_page_boundaries_that_break(fragmentation):
    pages, need = fragmented_pages(101, fragmentation, np.random.default_rng(0))
    assert sorted(pages) == sorted(set(pages)) and max(pages) < need
    breaks = sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)
    assert breaks == round(fragmentation * 100)


@pytest.mark.parametrize("tp", ["1:2", "2:1", "2:2"])
def test_tp_splits_the_window_by_the_heads_each_rank_holds(capsys, tp):
    tokens, layers, heads, head_dim = 200, 3, 3, 16
    rc = main(["--tokens", str(tokens), "--page-size", "8", "--layers", str(layers), "--kv-heads", str(heads),
               "--head-dim", str(head_dim), "--dtype", "float32", "--repeats", "1", "--tp", tp, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    total = tokens * layers * 2 * heads * head_dim * 4
    assert out["tp"] == tp and out["verified"] is True
    assert out["bytes"] == out["expected_bytes"] == total and out["plan_checked_tokens"] == tokens
    senders, receivers = (int(n) for n in tp.split(":"))
    for side, ranks in (("src", senders), ("dst", receivers)):
        rows = out["per_rank"][side]
        assert [r["rank"] for r in rows] == list(range(ranks))
        assert sum(r["bytes"] for r in rows) == total
        assert sum(r["descriptors"] for r in rows) == out["descriptors"]
        # head_ranges' floor split of 3 heads: one rank holds [0, 1), the other [1, 3)
        want = [[0, 3]] if ranks == 1 else [[0, 1], [1, 3]]
        assert [r["heads"] for r in rows] == want
        assert [r["bytes"] for r in rows] == [total * (e - b) // heads for b, e in want]
        for r in rows:  # every rank's rate is over the one write's median time
            assert r["gbps"] == pytest.approx(out["kv_gbps"] * r["bytes"] / total, rel=1e-3, abs=2e-6)
    if tp == "2:2":  # both sides split alike: whole slots move, one descriptor per run of pages
        assert out["descriptors"] < tokens
    else:  # a partial-head pair moves one descriptor per position, layer and K/V
        assert out["descriptors"] == tokens * layers * 2 * 2


@pytest.mark.parametrize("value, kv_heads, says", [
    ("0:1", 3, "rank counts must be positive"),
    ("2", 3, "give both rank counts"),
    ("3:2", 2, "3 ranks cannot share 2 KV heads"),
])
def test_tp_rejects_bad_values_by_name(capsys, value, kv_heads, says):
    with pytest.raises(SystemExit):
        main(["--kv-heads", str(kv_heads), "--tp", value])
    err = capsys.readouterr().err
    assert value in err and says in err
