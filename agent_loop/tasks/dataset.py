"""Tasks from data: prompts from a list, JSONL, Parquet or a Hugging Face dataset on disk; rewards from
Python callables, weighted sums of them, or built-in rules (:mod:`agent_loop.tasks.rewards`); tools from
plain functions or MCP-style schemas (:mod:`agent_loop.episode.tools`).

The short path::

    from agent_loop import DatasetTask

    def reverse(text: str) -> str:
        '''Reverse a string.

        Args:
            text: The string to reverse.
        '''
        return text[::-1]

    task = DatasetTask([{"prompt": "Reverse 'abc'.", "answer": "cba"}], reward="exact", tools=[reverse])

Rows. Each row is a dict with a prompt (``prompt``: a string, or a list of chat messages as in verl's
parquet files; ``messages`` works too) and optionally a reference answer (``answer``, or verl's
``reward_model.ground_truth``). Every other column is kept as the row's metadata: it goes into
``Trajectory.info["row"]`` and reaches reward functions as ``row``. A file with bad rows keeps its good
rows; each bad one is named ``FILE:LINE: reason`` in ``DatasetTask.skipped`` and in a warning.

Demonstrations (optional, for ``agent-loop warmstart``): a ``demonstration`` column holding a solved
episode's messages (the shape :meth:`Task.demonstrate` returns) makes the task demonstrate those rows.

Rewards. A reward function takes, by name, any of ``completion`` (the final answer: the text of the
last assistant message, "" if that message still calls a tool), ``answer``, ``messages``,
``tool_calls`` (``ToolCallRecord`` list), ``row`` and ``episode``, and returns a number. Several
functions are summed with ``reward_weights`` (1.0 each by default), as in TRL; each one's value is
kept in ``info["rewards"]``. A function that raises or returns a non-number ends that episode with
finish "error", reward 0.0 (never a partial sum) and the message in ``info["reward_error"]``; the run
goes on and a training step drops the episode (counted). Built-in rules by name: ``exact``,
``contains``, ``number`` (tolerant: :func:`~agent_loop.tasks.rewards.number_close`), ``regex:PATTERN``
(see :data:`RULES`).

Per-turn rewards (optional): ``turn_reward`` takes, by name, any of ``turn``, ``message`` (that
assistant turn's message), ``tool_calls`` (that turn's calls), ``answer``, ``row``, ``messages``,
``episode`` and returns a number; the loop places it on the turn's last assistant token. One that raises
or returns a non-number fails the episode the same way.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from agent_loop.episode.contracts import Task, episode_rng
from agent_loop.episode.tools import tool
from agent_loop.options import plural
from agent_loop.tasks.rewards import (
    TURN_REWARD_ARGUMENTS,
    argument_picker,
    as_reward,
    function_name,
    raised,
    reward_terms,
    score_episode,
)
from agent_loop.types import Episode, ToolCallRecord, json_values

ROLES = ("system", "user", "assistant", "tool")
LINE_FORMATS = (".jsonl", ".json")  # one JSON object (or string) per line; a .json file may hold one JSON array
FORMATS = ("a .jsonl or .json file (one JSON object per line; a .json file may hold one JSON array of them), a "
           ".parquet file, or a folder saved by datasets' save_to_disk")


# --- rows ----------------------------------------------------------------------------------------


def _messages_of(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f"prompt message {i} must be a dict with a role in {ROLES} and a string content, got {message!r}")
            messages.append({"role": message["role"], "content": message["content"]})
        return messages
    raise ValueError(f"prompt must be a non-empty string or list of messages, got {prompt!r}")


def _plain(value: Any) -> Any:
    """Metadata as JSON values (a Trajectory is written as JSON): numpy and torch scalars and arrays become their
    values (``np.int64(8)`` -> 8, an array -> a list), any other object its ``str``."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=_json_default))


def _json_default(value: Any) -> Any:
    return value.tolist() if callable(getattr(value, "tolist", None)) else str(value)


def normalize_row(row: Any, prompt_key: str = "prompt", answer_key: str = "answer") -> dict:
    """``{"messages", "answer", "row"}`` from one dataset row (see the module docstring); ValueError if unusable."""
    if isinstance(row, str):
        row = {prompt_key: row}
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    key = prompt_key if prompt_key in row else "messages" if "messages" in row else None
    if key is None:
        raise ValueError(f"no {prompt_key!r} field (keys: {', '.join(map(str, row)) or 'none'})")
    answer = row.get(answer_key)
    if answer is None and isinstance(row.get("reward_model"), dict):  # verl's parquet layout
        answer = row["reward_model"].get("ground_truth")
    metadata = {k: v for k, v in row.items() if k not in (key, answer_key)}
    return {"messages": _messages_of(row[key]), "answer": _plain(answer), "row": _plain(metadata)}


MAX_ROW_BYTES = 16 << 20  # a longer line is skipped unread (a binary file, a runaway row), not loaded


def _read_jsonl(path: Path) -> Iterable[tuple[str, Any]]:
    """Each line's row, or the ValueError that makes it a bad row (not UTF-8, not JSON, too long)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), 1):
            where = f"{path}:{number}"
            if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass  # skip the rest of the line a block at a time
                yield where, ValueError(f"longer than {MAX_ROW_BYTES} bytes")
                continue
            if not raw.strip():
                continue
            try:
                yield where, json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))  # a leading BOM
            except UnicodeDecodeError as error:
                yield where, ValueError(f"not UTF-8 text (byte {error.start} of the line)")
            except json.JSONDecodeError as error:
                yield where, ValueError(f"not JSON ({error.msg} at column {error.colno})")


def _read_json_array(path: Path) -> Iterable[tuple[str, Any]] | None:
    """The rows of a ``.json`` file that holds one JSON array (read whole), or None when it does not start with
    ``[`` (JSON Lines, read a line at a time). ValueError naming the place if the array is not JSON."""
    with open(path, "rb") as f:
        start = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if path.suffix != ".json" or start != b"[":
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Windows editors) is no row
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: a JSON array that is not JSON ({error.msg} at line {error.lineno} column "
                         f"{error.colno})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not one JSON array")
    return ((f"{path}:row {i}", row) for i, row in enumerate(rows))


def _read_table(source: Any, split: str | None) -> Iterable[tuple[str, Any]]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # pyarrow: optional (the data extra)

            rows = pq.read_table(path).to_pylist()
        else:
            from datasets import DatasetDict, load_from_disk  # datasets: optional (the data extra)

            try:
                source = load_from_disk(str(path))
            except (FileNotFoundError, OSError) as error:  # a folder datasets did not write
                raise ValueError(f"not a folder saved by datasets' save_to_disk ({error}); accepted: {FORMATS}") from None
            if isinstance(source, DatasetDict):
                names = list(source)
                chosen = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
                if chosen not in names:
                    raise ValueError(f"{path}: choose a split with split=... (splits: {', '.join(names)})")
                source = source[chosen]
            rows = source
        label = str(path)
    else:
        rows, label = source, type(source).__name__
    for i, row in enumerate(rows):
        yield f"{label}:row {i}", row


def load_prompts(source: Any, prompt_key: str = "prompt", answer_key: str = "answer",
                 split: str | None = None) -> tuple[list[dict], list[str]]:
    """Rows of ``source`` and the bad ones: ``(rows, skipped)``, each skipped entry ``"FILE:LINE: reason"``.

    ``source``: a list of dicts or strings, a ``.jsonl`` file, a ``.parquet`` file, a folder written by
    ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: ``split``, default ``train``), or a
    ``datasets.Dataset``. ValueError if the source does not exist or has no usable row.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise ValueError(f"prompts file not found: {path}")
        if path.is_file() and path.suffix not in (*LINE_FORMATS, ".parquet"):
            raise ValueError(f"unknown prompts format {path.suffix or '(no suffix)'} (accepted: {FORMATS})")
        if path.suffix in LINE_FORMATS:
            items = _read_json_array(path) or _read_jsonl(path)
        else:
            items = _read_table(path, split)
    elif isinstance(source, (list, tuple)):
        items = ((f"prompts[{i}]", row) for i, row in enumerate(source))
    else:
        items = _read_table(source, split)
    rows, skipped, repaired = [], [], []
    for where, raw in items:
        try:
            if isinstance(raw, Exception):
                raise raw
            row, repairs = json_values(normalize_row(raw, prompt_key, answer_key))  # numpy values -> plain ones too
        except ValueError as error:
            skipped.append(f"{where}: {error}")
            continue
        rows.append(row)
        if repairs:  # a lone surrogate (valid JSON, unencodable text) would break the tokenizer and the writer
            repaired.append(f"{where}: {', '.join(f'{n} {kind}' for kind, n in repairs.items())}")
    if repaired:
        warnings.warn(f"{len(repaired)} prompt rows held values text cannot hold (lone surrogates -> U+FFFD, "
                      "NaN -> null), replaced: " + "; ".join(repaired[:5]) + (" ..." if len(repaired) > 5 else ""),
                      stacklevel=2)
    if not rows:
        detail = "; ".join(skipped[:3]) or "it is empty"
        raise ValueError(f"no usable prompt in {source if isinstance(source, (str, Path)) else 'the prompts'}: {detail}")
    return rows, skipped


# --- the tasks ------------------------------------------------------------------------------------


class DatasetTask(Task):
    """A task whose episodes are the rows of a dataset (see the module docstring).

    Episode ``i`` plays row ``i % len(rows)``: in file order, or with ``shuffle`` in a new order every
    pass through the data (deterministic in the seed and the pass).
    """

    def __init__(self, prompts: Any, reward: Callable | str | Sequence[Callable | str], tools: Sequence[Callable] = (),
                 *, reward_weights: Sequence[float] | None = None, turn_reward: Callable | None = None,
                 system: str | None = None, name: str = "dataset", shuffle: bool = False,
                 prompt_key: str = "prompt", answer_key: str = "answer", split: str | None = None,
                 demonstration_key: str = "demonstration"):
        self.name = name
        self.rows, self.skipped = load_prompts(prompts, prompt_key, answer_key, split)
        self.demonstration_key = demonstration_key
        if any(demonstration_key in row["row"] for row in self.rows):  # only then can it be warm-started
            self.demonstrate = self._demonstration_of
        if self.skipped:
            warnings.warn(f"{plural(len(self.skipped), 'bad prompt row')} skipped ({len(self.rows)} kept): "
                          + "; ".join(self.skipped[:5]) + (" ..." if len(self.skipped) > 5 else ""), stacklevel=2)
        self.rewards = reward_terms(reward, reward_weights)
        self.turn_reward = turn_reward
        self._turn_picker = turn_reward and argument_picker(turn_reward, TURN_REWARD_ARGUMENTS, "turn reward")
        self.tools = [tool(fn) for fn in tools]
        self.system = system
        self.shuffle = shuffle

    def __len__(self) -> int:
        return len(self.rows)

    def row_index(self, index: int, seed: int = 0) -> int:
        """The row that episode ``index`` plays."""
        rounds, position = divmod(index, len(self.rows))
        if not self.shuffle:
            return position
        order = list(range(len(self.rows)))
        episode_rng(self.name, seed, rounds).shuffle(order)
        return order[position]

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        row_index = self.row_index(index, seed)
        row = self.rows[row_index]
        messages = copy.deepcopy(row["messages"])
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return Episode(messages=messages, tools=list(self.tools), answer=row["answer"],
                       info={"row_index": row_index, "row": row["row"]})

    def _demonstration_of(self, episode: Episode, rng) -> list[dict] | None:
        """:meth:`Task.demonstrate` from the episode's row: its ``demonstration_key`` column, None without one."""
        return copy.deepcopy(episode.info["row"].get(self.demonstration_key))

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        """The weighted sum of the reward functions; :class:`RewardError` if any of them fails (an error episode)."""
        return score_episode(self.rewards, episode, messages, tool_calls)

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float] | None:
        """One reward per assistant turn from ``turn_reward`` (None without one); :class:`RewardError` if it
        raises or returns a non-number (an error episode, as for the outcome reward)."""
        if self.turn_reward is None:
            return None
        replies = [m for m in messages[len(episode.messages):] if m.get("role") == "assistant"]
        base = {"answer": episode.answer, "row": episode.info.get("row", {}), "messages": messages, "episode": episode}
        try:
            return [as_reward(self.turn_reward(**self._turn_picker(
                {**base, "turn": turn, "message": message, "tool_calls": [c for c in tool_calls if c.turn == turn]}))) for turn, message in enumerate(replies)]
        except Exception as error:  # a user's reward bug: this episode fails (agent_loop.episode.loop._score)
            raise raised(f"turn reward {function_name(self.turn_reward)!r}", error) from error
