"""agent_loop.files, the one atomic write, on real files: a writer that fails leaves the old output as it was
and nothing temporary behind, an existing output is never truncated, and every copy of the concept uses it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent_loop import files

ROOT = Path(__file__).resolve().parents[2]


class Crash(RuntimeError):
    pass


def _crash_after(text: str):
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)  # half of the new content is on disk when the writer dies
            f.flush()
        raise Crash("killed mid-write")
    return write


def test_a_writer_that_raises_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "out.html"
    target.write_text("old page")
    with pytest.raises(Crash):
        files.write_file(target, _crash_after("half a new pa"))
    assert target.read_text() == "old page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.html"]


def test_a_replace_never_truncates_the_existing_file_in_place(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("step 1\nstep 2\n")
    reader = tmp_path / "reader-link"  # a second name of the old file: what a reader holding it open sees
    os.link(target, reader)
    files.write_text(target, "step 1\n")
    assert target.read_text() == "step 1\n"
    assert reader.read_text() == "step 1\nstep 2\n"  # a truncate-and-rewrite would have emptied this inode
    assert os.stat(reader).st_ino != os.stat(target).st_ino


def test_exist_ok_false_refuses_an_existing_file_and_keeps_it(tmp_path):
    target = tmp_path / "rollouts.jsonl"
    files.write_text(target, "first\n", exist_ok=False)
    assert target.read_text() == "first\n"
    with pytest.raises(FileExistsError):
        files.write_text(target, "second\n", exist_ok=False)
    assert target.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"]


def test_the_file_gets_the_mode_of_a_plain_open_and_is_fsynced_with_its_folder(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    target = files.write_text(tmp_path / "new.txt", "x")
    assert target.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert synced[-1] == str(tmp_path)  # the rename is on disk: the folder last
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/\.new\.txt\..*\.tmp", synced[-2])  # the content before


def _fill(content: str, *, crash: bool = False):
    def fill(folder: Path) -> str:
        (folder / "sub").mkdir()
        (folder / "a.txt").write_text(content)
        (folder / "sub" / "b.txt").write_text(content * 2)
        if crash:
            raise Crash("killed while filling")
        return "record"
    return fill


def test_a_folder_is_published_whole_and_a_failed_fill_leaves_the_old_one(tmp_path):
    target = tmp_path / "model"
    assert files.write_folder(target, _fill("v1")) == "record"
    with pytest.raises(Crash):
        files.write_folder(target, _fill("v2", crash=True))
    assert (target / "a.txt").read_text() == "v1" and (target / "sub" / "b.txt").read_text() == "v1v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    files.write_folder(target, _fill("v3"))  # an existing folder is swapped out, not removed first
    assert (target / "a.txt").read_text() == "v3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_scratch_folder_left_by_a_killed_writer_is_cleared(tmp_path):
    target = tmp_path / "step_000002"
    stale = files.staging_path(target)
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"\0" * 10)
    files.write_folder(target, _fill("new"))
    assert not stale.exists()
    assert sorted(p.name for p in target.rglob("*")) == ["a.txt", "b.txt", "sub"]


def test_move_aside_takes_the_first_free_name_and_overwrites_nothing(tmp_path):
    kept = tmp_path / "step_000003.jsonl.interrupted"
    kept.write_text("earlier")
    (tmp_path / "step_000003.jsonl").write_text("later")
    moved = files.move_aside(tmp_path / "step_000003.jsonl", "interrupted")
    assert moved.name == "step_000003.jsonl.interrupted-2" and moved.read_text() == "later"
    assert kept.read_text() == "earlier"


def test_a_checkpoint_folder_has_its_manifest_and_a_failed_save_keeps_the_previous(tmp_path):
    from agent_loop.training import checkpoint

    folder = tmp_path / "model"
    checkpoint.write_folder(folder, fill=_fill("w1"), manifest={"kind": "warm start"})
    assert checkpoint.problems(folder) == [] and checkpoint.damaged(folder) == []
    with pytest.raises(Crash):
        checkpoint.write_folder(folder, fill=_fill("w2", crash=True))
    assert (folder / "a.txt").read_text() == "w1" and checkpoint.problems(folder) == []
    (folder / "a.txt").write_text("w9")  # same size, other bytes
    assert checkpoint.damaged(folder) == ["a.txt"]


def test_no_other_module_renames_files_into_place_itself():
    """The concept is written once: os.replace / rename / fsync only in agent_loop/files.py (and masking's
    compiled-loop cache, which may not import agent_loop), in the packages and in the benchmarks and test
    helpers that build into the cache."""
    allowed = {"agent_loop/files.py", "masking/native.py"}
    found = []
    for folder in ("agent_loop", "trainer", "masking", "advantages", "benchmarks", "tests/helpers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in allowed and re.search(r"os\.replace\(|os\.rename\(|\.rename\(|os\.fsync\(",
                                                 path.read_text(encoding="utf-8")):
                found.append(name)
    assert set(found) <= KNOWN_ELSEWHERE, found


# a JSONL file's torn-tail repair fsyncs the file it cut in place, which is no atomic write
KNOWN_ELSEWHERE = {"agent_loop/runners/jsonl.py"}


def test_fetch_reads_the_cache_folder_without_loading_torch(tmp_path):
    code = ("import sys; import agent_loop.builtin_models as m; m.SMOLLM2_135M.wheel_path(); m.status(m.SMOLLM2_135M); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AGENT_LOOP_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
