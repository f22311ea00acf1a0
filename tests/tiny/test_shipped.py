"""The shipped tiny-agent builds: checked by sha256, unpacked into the cache's layout, and still what the
recipe makes on this machine (within sampling noise)."""

import json
import math
import tarfile

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loop.tiny import build as tiny_build


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
    assert tiny_build.shipped_archive("tiny-agent-v8-steps10") is None
    assert not tiny_build.unpack_shipped(tmp_path / "tiny-agent-v8-steps10")


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
def test_the_recipe_still_makes_an_agent_that_behaves_like_the_shipped_one(tmp_path):
    target = tmp_path / tiny_build.build_dir().name
    built = tiny_build.build(target, progress=False)
    shipped_path = tmp_path / "shipped" / target.name
    shipped_path.parent.mkdir()
    tiny_build.unpack_shipped(shipped_path)
    shipped = json.loads((shipped_path / "build.json").read_text())
    assert built["vocab_size"] == shipped["vocab_size"] and built["parameters"] == shipped["parameters"]
    for stage in tiny_build.STAGES:
        for mine, theirs in zip(built["stages"][stage]["eval"], shipped["stages"][stage]["eval"], strict=True):
            assert (mine["task"], mine["greedy"], mine["episodes"]) == (theirs["task"], theirs["greedy"], theirs["episodes"])
            for key in ("well_formed", "right_arguments", "success"):
                assert _within_noise(mine[key], theirs[key], mine["episodes"]), (stage, mine, theirs)
