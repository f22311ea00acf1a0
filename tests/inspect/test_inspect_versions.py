"""``agent-loop inspect --color-by version``: assistant tokens coloured by the policy version that sampled them
(``Trajectory.policy_versions``, written by the trainer's step files), on an episode the real loop played
across a weight update (scripted replies stamped with version 3, then 4, on the real Qwen2.5 tokenizer)."""

from __future__ import annotations

import asyncio
import json

import pytest
from rich.console import Console

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.inspect import main
from agent_loop.episode.loop import run_episode
from agent_loop.inspect import terminal
from agent_loop.inspect.tokens import segments, versions_note
from agent_loop.inspect.view import build_view
from agent_loop.types import Trajectory
from masking.spans import SpanKind
from tests.helpers.echo_task import EchoTask  # the same one-tool task


class AcrossAnUpdate(ScriptedBackend):
    """Scripted replies; the first request of an episode is stamped version 3, the later ones version 4."""

    async def generate(self, prompt_ids, sampling, session_id=None):
        result = await super().generate(prompt_ids, sampling, session_id)
        return result._replace(policy_version=3 if len(self.calls) == 1 else 4)


@pytest.fixture(scope="module")
def played(qwen_tokenizer) -> Trajectory:
    def script(prompt_ids):
        if "<tool_response>" in qwen_tokenizer.decode(prompt_ids):
            return qwen_tokenizer.encode("done", add_special_tokens=False)
        return qwen_tokenizer.encode('<tool_call>\n{"name": "echo", "arguments": {"text": "hello"}}\n</tool_call>',
                                     add_special_tokens=False)

    trajectory = asyncio.run(run_episode(EchoTask(), 0, AcrossAnUpdate(script), qwen_tokenizer))
    return Trajectory.from_json(trajectory.to_json())  # what a file holds


def test_the_loop_records_each_turns_version_and_the_file_keeps_it(played):
    versions = {(turn, span): {v for v, t, s in zip(played.policy_versions, played.turn_ids, played.spans)
                               if (t, s) == (turn, span)} for turn in (0, 1) for span in (SpanKind.ASSISTANT, SpanKind.OBSERVATION)}
    assert versions[(0, SpanKind.ASSISTANT)] == {3} and versions[(1, SpanKind.ASSISTANT)] == {4}
    assert versions[(0, SpanKind.OBSERVATION)] == {-1}
    n3, n4 = played.policy_versions.count(3), played.policy_versions.count(4)
    assert versions_note(played) == f"policy versions 3-4 (partial rollout: {n3} tokens of version 3, {n4} of 4)"
    played.check()
    with pytest.raises(ValueError, match="policy_versions has 1 entries"):
        Trajectory.from_dict({**json.loads(played.to_json()), "policy_versions": [3]}).check()


def test_color_by_version_colours_assistant_tokens_by_version_and_says_so(played, tmp_path, capsys):
    view = build_view([played])
    by_span = [terminal.segment_text(view, 0, seg) for seg in segments(played)]
    by_version = [terminal.segment_text(view, 0, seg, "version") for seg in segments(played)]
    styles = [{str(span.style) for span in text.spans} for text in by_version]
    kinds = [seg.span for seg in segments(played)]
    assert kinds == [SpanKind.ASSISTANT, SpanKind.OBSERVATION, SpanKind.ASSISTANT]
    assert styles[0] == {terminal.VERSION_STYLES[0]} and styles[2] == {terminal.VERSION_STYLES[1]}  # oldest, +1
    assert styles[1] == {str(span.style) for span in by_span[1].spans}  # observations keep their span colour

    path = tmp_path / "step.jsonl"
    path.write_text(played.to_json() + "\n")
    assert main([str(path), "--color-by", "version", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "policy versions 3-4 (partial rollout" in out and "assistant tokens by policy version" in out
    html = tmp_path / "page.html"
    assert main([str(path), "--quiet", "--html", str(html)]) == 0
    page = html.read_text()
    assert f'"ver":{json.dumps(played.policy_versions, separators=(",", ":"))}' in page  # the page's token data
    assert "['policy version',d.ver[k]]" in page and "partial rollout" in page  # tooltip and header

    unversioned = tmp_path / "plain.jsonl"
    unversioned.write_text(Trajectory.from_dict({**json.loads(played.to_json()), "policy_versions": None}).to_json() + "\n")
    assert main([str(unversioned), "--color-by", "version", "--width", "200"]) == 0
    assert "record no policy versions" in capsys.readouterr().err
    console = Console(record=True, width=200)
    terminal.render(build_view([played]), console, color_by="version")
    assert "oldest" in console.export_text()
