"""Generate the chat-template table of docs/templates.md: every template the tests use, with its verdict.

For each template in tests/data/chat_templates (rendered with the real Qwen2.5 tokenizer, the other
families' special markers added as special tokens, exactly as tests/episode/test_chat_templates.py does):

- strict mode: ``exact`` (a multi-turn conversation built turn by turn equals its one-go render) or
  ``refused`` with the TemplateError's first sentence (the true cause);
- keep_seen mode (only for refused templates): whether it runs, and at which turns it records drift;
- the tool-call parser selected from the template text, and whether the calls it renders round-trip.

    .venv/bin/python scripts/template_table.py            # print the table
    .venv/bin/python scripts/template_table.py --write    # replace the table in docs/templates.md
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "episode")]  # tests.helpers; test_chat_templates

BEGIN, END = "<!-- BEGIN GENERATED TABLE -->", "<!-- END GENERATED TABLE -->"


def _tokenizer():
    from test_chat_templates import MARKER
    from transformers import AutoTokenizer

    from tests.helpers.testdata import TEMPLATE_FILES, TEMPLATES_DIR, qwen_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    markers = sorted({m for name in TEMPLATE_FILES for m in MARKER.findall((TEMPLATES_DIR / name).read_text())})
    tok.add_special_tokens({"additional_special_tokens": [m for m in markers if m not in tok.get_vocab()]},
                           replace_extra_special_tokens=False)
    return tok


def _reason(error: Exception) -> str:
    text = str(error).split(". pass history_mode")[0].split("; add that marker")[0]
    return text.replace("|", "\\|").replace("\n", "\\n")[:220]


def _first_observation(messages):
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    nxt = next(j for j in range(first + 1, len(messages)) if messages[j]["role"] == "assistant")
    return messages[first + 1: nxt]


def _keep_seen_run(formatter, messages) -> str:
    """Play the conversation's observations in keep_seen mode; the turns that record drift."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    _, seen = formatter.prompt(messages[:first])
    drift, i, turn = [], first, 0
    while (nxt := next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"), None)) is not None:
        alone = formatter.render_text(messages[: i + 1])  # the model stops on the marker that ends its turn there
        ends = sorted((alone.find(t, len(seen)), k) for k, t in formatter._stop_texts.items() if t in alone[len(seen):])
        obs = formatter.observation(messages[: i + 1], seen, messages[i + 1: nxt], ends[0][1] if ends else None)
        assert all(str(m["content"]) in formatter.tokenizer.decode(obs.ids) for m in messages[i + 1: nxt])
        if obs.mismatch is not None:
            drift.append(turn)
        seen, i, turn = obs.rendered, nxt, turn + 1
    return f"runs; drift recorded at turn(s) {drift}" if drift else "runs; no drift in the tested chat"


def rows(tokenizer) -> list[tuple[str, ...]]:
    from test_chat_templates import (
        CALCULATOR,
        NOT_APPEND_ONLY,
        TEMPLATE_KWARGS,
        build_token_by_token,
        conversation_for,
        make_formatter,
    )
    from test_parser_roundtrip import LOSSY

    from agent_loop.episode.chat import ChatFormatter, TemplateError
    from agent_loop.episode.tool_formats import parser_for_template
    from tests.helpers.testdata import TEMPLATE_FILES, read_template

    out = []
    for name in TEMPLATE_FILES:
        template = read_template(name)
        strict, keep = "", "—"
        try:
            formatter = make_formatter(tokenizer, name, template)
            messages = conversation_for(name, template, formatter)
            formatter.history_dependence(_first_observation(messages))  # the probe: refuses what is not append-only
            *_, mismatches, _ = build_token_by_token(formatter, messages)
            strict = "exact" if all(m is None for m in mismatches) else f"mismatch recorded at turns {mismatches}"
        except TemplateError as e:
            strict = f"refused: {_reason(e)}"
            try:
                kwargs = {"bos_token": ""} | TEMPLATE_KWARGS.get(name, {})
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt_in = ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=template,
                                           history_mode="keep_seen", **kwargs)
                    keep = _keep_seen_run(opt_in, conversation_for(name, template, opt_in))
            except TemplateError as e2:
                keep = f"refused: {_reason(e2)}"
        assert (name in NOT_APPEND_ONLY) == strict.startswith("refused"), f"{name}: table and tests disagree"
        uses_tools = "tool_call" in template or "tool_calls" in template
        try:
            parser = parser_for_template(template).__name__.removeprefix("parse_")
            calls = f"lossy template: {LOSSY[name]}" if name in LOSSY else "round-trips"
        except ValueError:
            parser, calls = "—", "no tool calls" if not uses_tools else "no parser"
        out.append((name, strict, keep, parser, calls if uses_tools else "template renders no tool calls"))
    return out


def table(tokenizer) -> str:
    lines = ["| template | strict (default) | history_mode=\"keep_seen\" | parser | tool calls |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(tokenizer)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the generated table in docs/templates.md")
    args = parser.parse_args()
    doc = ROOT / "docs" / "templates.md"
    if args.write:
        text = doc.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to replace")
    result = table(_tokenizer())
    if not args.write:
        print(result)
        return
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + BEGIN + "\n" + result + "\n" + END + rest.split(END, 1)[1])
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
