"""`--model` of the benchmarks: the real model by default, any known name or directory,
and the name, directory and dtype every result records."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks import engine
from pdserve.benchmarks.model_choice import MeasuredModel, node_dtype, resolve, resolve_or_exit
from pdserve.benchmarks.serve.cli import build_parser as serve_parser
from pdserve.models.catalogue import CARD_FILE, UnknownModel


def test_both_benchmarks_default_to_the_real_model():
    assert engine.build_parser().parse_args([]).model == "smollm2-135m-instruct"
    assert serve_parser().parse_args(["--compare"]).model == "smollm2-135m-instruct"


def test_the_random_model_is_an_option_and_model_dir_an_alias():
    assert engine.build_parser().parse_args(["--model", "bench-random-100m"]).model == \
        "bench-random-100m"
    assert engine.build_parser().parse_args(["--model-dir", "/ckpt"]).model == "/ckpt"
    assert serve_parser().parse_args(["--compare", "--model", "bench-random-100m"]).model == \
        "bench-random-100m"


def test_a_converted_directory_is_recorded_under_its_catalogue_name(tmp_path):
    (tmp_path / CARD_FILE).write_text(json.dumps({"name": "smollm2-135m-instruct"}))
    model = resolve(str(tmp_path))
    assert model == MeasuredModel("smollm2-135m-instruct", str(tmp_path))
    assert model.record("bfloat16") == {"name": "smollm2-135m-instruct", "dir": str(tmp_path),
                                        "dtype": "bfloat16"}
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve(str(plain)).name == str(plain)  # no card: the directory is its name


def test_an_unknown_model_names_every_known_one(capsys):
    with pytest.raises(UnknownModel, match="smollm2-135m-instruct.*bench-random-100m"):
        resolve("no-such-model")
    with pytest.raises(SystemExit) as exit_:
        resolve_or_exit("no-such-model", "pdserve bench engine")
    assert exit_.value.code == 2
    assert "pdserve bench engine: error: --model 'no-such-model'" in capsys.readouterr().err


def test_the_workers_dtype_comes_from_their_flags_then_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)
    assert node_dtype([]) == "float32"
    assert node_dtype(["--kv-cache-mb", "512", "--dtype", "bfloat16"]) == "bfloat16"
    monkeypatch.setenv("PDSERVE_DTYPE", "bfloat16")
    assert node_dtype(["--kv-cache-mb", "512"]) == "bfloat16"
    assert node_dtype(["--dtype=float32"]) == "float32"


def test_bench_serve_finds_the_tokenizer_of_a_model_served_by_name(tmp_path, monkeypatch):
    from pdserve.benchmarks.serve.runs import _served_dir

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    converted = tmp_path / "models" / "smollm2-135m-instruct"
    converted.mkdir(parents=True)
    assert _served_dir("smollm2-135m-instruct") is None  # no card: not converted
    (converted / CARD_FILE).write_text(json.dumps({"name": "smollm2-135m-instruct"}))
    assert _served_dir("smollm2-135m-instruct") == str(converted)
    assert _served_dir(str(tmp_path)) == str(tmp_path)
    assert _served_dir("no-such-model") is None and _served_dir("") is None
