"""Smoke test of `pdserve bench transfer` with tiny sizes: JSON fields, plot, and arithmetic."""

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
