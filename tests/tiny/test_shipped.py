"""The shipped tiny-agent builds: checked by sha256, unpacked into the cache's layout, and still what the
recipe makes on this machine (within sampling noise)."""

import hashlib
import json
import math
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loop.tiny import build as tiny_build
from agent_loop.tiny import pinned


def test_the_shipped_build_unpacks_into_a_loadable_cache_folder(tmp_path):
    target = tmp_path / tiny_build.build_dir().name
    assert tiny_build.shipped_archive(target.name) is not None, "the default recipe's build is shipped"
    assert tiny_build.unpack_shipped(target)
    record = json.loads((target / "build.json").read_text())
    assert record["recipe"] == tiny_build.RECIPE_VERSION and set(record["stages"]) == set(tiny_build.STAGES)
    assert "sha256" in (target / "shipped.txt").read_text()
    for stage in tiny_build.STAGES:
        model = AutoModelForCausalLM.from_pretrained(target / stage, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(target / stage)
        assert len(tokenizer) == record["vocab_size"] and model.num_parameters() == record["parameters"]
    assert not list(tmp_path.glob(".*unpack-*")), "the scratch folder is removed"


def test_a_damaged_archive_is_refused_and_nothing_is_unpacked(tmp_path, monkeypatch):
    target = tmp_path / tiny_build.build_dir().name
    monkeypatch.setitem(tiny_build.SHIPPED_SHA256, target.name, "0" * 64)
    with pytest.raises(RuntimeError, match="is damaged .*restore it from git"):
        tiny_build.unpack_shipped(target)
    assert not target.exists()


def test_an_unshipped_build_is_not_unpacked(tmp_path):
    assert tiny_build.shipped_archive(f"tiny-agent-{tiny_build.RECIPE_VERSION}-steps10") is None
    assert not tiny_build.unpack_shipped(tmp_path / f"tiny-agent-{tiny_build.RECIPE_VERSION}-steps10")


def test_the_archive_holds_only_the_build_folder(tmp_path):
    name = tiny_build.build_dir().name
    with tarfile.open(tiny_build.shipped_archive(name)) as tar:
        members = tar.getmembers()
    assert all(m.name.split("/")[0] == name and (m.isfile() or m.isdir()) for m in members)
    assert {m.name for m in members if m.isfile()} >= {f"{name}/build.json", f"{name}/final/model.safetensors",
                                                        f"{name}/mid/model.safetensors"}


def _within_noise(built: float, shipped: float, episodes: int) -> bool:
    # two independent binomial estimates of one rate: 4 standard errors of their difference, plus one episode
    p = min(max((built + shipped) / 2, 0.05), 0.95)
    return abs(built - shipped) <= 4 * math.sqrt(2 * p * (1 - p) / episodes) + 1 / episodes


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(2400)  # 681 s alone on one core; beside the other xdist worker it ran past 900 s
def test_the_recipe_still_makes_an_agent_that_behaves_like_the_shipped_one(tmp_path):
    target = tmp_path / tiny_build.build_dir().name
    built = tiny_build.build(target, progress=False)
    shipped_path = tmp_path / "shipped" / target.name
    shipped_path.parent.mkdir()
    tiny_build.unpack_shipped(shipped_path)
    shipped = json.loads((shipped_path / "build.json").read_text())
    assert built["vocab_size"] == shipped["vocab_size"] and built["parameters"] == shipped["parameters"]
    if pinned.can_pin():
        assert built["numerics"] == shipped["numerics"], "the recipe ran with the shipped build's pinned numerics"
    for stage in tiny_build.STAGES:
        for mine, theirs in zip(built["stages"][stage]["eval"], shipped["stages"][stage]["eval"], strict=True):
            assert (mine["task"], mine["greedy"], mine["episodes"]) == (theirs["task"], theirs["greedy"], theirs["episodes"])
            for key in ("well_formed", "right_arguments", "success"):
                assert _within_noise(mine[key], theirs[key], mine["episodes"]), (stage, mine, theirs)
    # bit-identity is expected on every x86-64 CPU with AVX2 (agent_loop.tiny.pinned), but only MKL's
    # documentation promises it across CPU makers: a difference is reported, not failed
    differ = [stage for stage in tiny_build.STAGES
              if _sha256(target / stage / "model.safetensors") != _sha256(shipped_path / stage / "model.safetensors")]
    if differ:
        warnings.warn(f"the recipe's {differ} weights here are not bit-identical to the shipped ones "
                      f"(numerics {built['numerics']}); their evaluations agree within noise")


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_numerics(path: str) -> None:  # run in the pinned child process
    Path(path).write_text(json.dumps(pinned.numerics()))


def _fail() -> None:
    raise SystemExit(3)


def test_the_recipe_runs_in_a_child_with_pinned_kernels_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENT_LOOP_TINY_THREADS", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports this module's functions
    if not pinned.can_pin():  # e.g. an arm64 machine: this process, its own kernels, and a warning that says so
        with pytest.warns(UserWarning, match="cannot run the tiny agent's pinned numerics"):
            pinned.run_pinned(_write_numerics, str(tmp_path / "numerics.json"))
        return
    pinned.run_pinned(_write_numerics, str(tmp_path / "numerics.json"))
    numerics = json.loads((tmp_path / "numerics.json").read_text())
    assert (numerics["aten"], numerics["mkl_cbwr"], numerics["threads"]) == ("AVX2", "COMPATIBLE,STRICT", 1)
    with pytest.raises(RuntimeError, match="build failed in its child process .exit 3"):
        pinned.run_pinned(_fail)


def test_where_the_cpu_cannot_pin_the_recipe_runs_here_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(pinned, "can_pin", lambda: False)
    threads = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="may differ from the shipped one"):
            pinned.run_pinned(_write_numerics, str(tmp_path / "numerics.json"))
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "numerics.json").read_text())["aten"] == torch.backends.cpu.get_cpu_capability()
