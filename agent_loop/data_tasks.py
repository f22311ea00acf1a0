"""Tasks from data: prompts from a list, JSONL, Parquet or a Hugging Face dataset on disk; rewards from
Python callables, weighted sums of them, or built-in rules; tools from plain functions or MCP-style schemas.

The short path (docs/design.md section 7)::

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

Rewards. A reward function takes, by name, any of ``completion`` (the final answer: the text of the
last assistant message, "" if that message still calls a tool), ``answer``, ``messages``,
``tool_calls`` (``ToolCallRecord`` list), ``row`` and ``episode``, and returns a number. Several
functions are summed with ``reward_weights`` (1.0 each by default), as in TRL; each one's value is
kept in ``info["rewards"]``. A function that raises or returns a non-number is recorded in
``info["reward_error"]`` and the episode's reward is 0.0 (never a partial sum); the run goes on.
Built-in rules by name: ``exact``, ``contains``, ``number``, ``regex:PATTERN`` (see :data:`RULES`).

Per-turn rewards (optional): ``turn_reward`` takes, by name, any of ``turn``, ``message`` (that
assistant turn's message), ``tool_calls`` (that turn's calls), ``answer``, ``row``, ``messages``,
``episode`` and returns a number; the loop places it on the turn's last assistant token.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import random
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from agent_loop.tasks import last_number
from agent_loop.tools import Tool
from agent_loop.types import Episode, ToolCallRecord

REWARD_ARGUMENTS = ("completion", "answer", "messages", "tool_calls", "row", "episode")
TURN_REWARD_ARGUMENTS = ("turn", "message", "tool_calls", "answer", "row", "messages", "episode")
ROLES = ("system", "user", "assistant", "tool")


# --- tools ---------------------------------------------------------------------------------------


def tool(fn: Callable) -> Callable:
    """Mark a plain function as a tool and check now that its schema can be derived (type hints and a
    Google-style docstring with an ``Args:`` entry per parameter); returns the function unchanged.

    Plain functions work as tools without it: the decorator only moves the error to definition time.
    """
    try:
        Tool.from_function(fn)
    except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
        raise TypeError(f"tool {getattr(fn, '__qualname__', fn)!r}: {error}") from None
    return fn


def _openai_schema(schema: dict) -> dict:
    """An MCP tool (``name``, ``description``, ``inputSchema``) or an OpenAI function schema -> OpenAI form."""
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        function = schema["function"]
    elif "name" in schema:
        function = {"name": schema["name"], "description": schema.get("description", ""),
                    "parameters": schema.get("inputSchema", schema.get("parameters", {"type": "object", "properties": {}}))}
    else:
        raise ValueError(f"not a tool schema (needs 'name' and 'inputSchema', or 'type': 'function'): {schema!r}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tool schema without a name: {schema!r}")
    function = {"description": "", "parameters": {"type": "object", "properties": {}}, **function}
    return {"type": "function", "function": function}


def tools_from_schemas(schemas: Sequence[dict] | str | Path, implementations: Any) -> list[Callable]:
    """Tools from MCP-style JSON schemas (a list, or a ``.json`` file holding one) and their implementations.

    ``implementations`` is a dict ``name -> callable``, a module (functions looked up by name), or one
    handler ``handler(name, arguments) -> result`` for every tool (sync or async), like an MCP server's
    ``call_tool``. The model sees the schemas as given; arguments are validated against them.
    """
    if isinstance(schemas, (str, Path)):
        schemas = json.loads(Path(schemas).read_text(encoding="utf-8"))
    if not isinstance(schemas, list):
        raise ValueError(f"tool schemas must be a list, got {type(schemas).__name__}")
    tools = []
    for raw in schemas:
        schema = _openai_schema(raw)
        name = schema["function"]["name"]
        if isinstance(implementations, dict) or inspect.ismodule(implementations):
            fn = implementations.get(name) if isinstance(implementations, dict) else getattr(implementations, name, None)
            if not callable(fn):
                raise ValueError(f"tool {name!r} has a schema but no implementation")
            tools.append(_with_schema(fn, schema))
        elif callable(implementations):
            tools.append(_with_schema(functools.partial(_call_handler, implementations, name), schema,
                                      is_async=inspect.iscoroutinefunction(implementations)))
        else:
            raise TypeError("implementations must be a dict, a module or a handler(name, arguments)")
    return tools


def _call_handler(handler: Callable, name: str, **arguments):
    return handler(name, arguments)


def _with_schema(fn: Callable, schema: dict, is_async: bool | None = None) -> Callable:
    """A function that calls ``fn`` and carries ``json_schema`` (read by ``agent_loop.tools``)."""
    if is_async if is_async is not None else inspect.iscoroutinefunction(fn):
        async def call(**arguments):
            return await fn(**arguments)
    else:
        def call(**arguments):
            return fn(**arguments)
    call.__name__ = call.__qualname__ = schema["function"]["name"]
    call.json_schema = schema
    Tool.from_function(call)  # check the schema now
    return call


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
    """Metadata as JSON values (a Trajectory is written as JSON)."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


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


def _read_jsonl(path: Path) -> Iterable[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, ValueError(f"not JSON ({error.msg} at column {error.colno})")


def _read_table(source: Any, split: str | None) -> Iterable[tuple[str, Any]]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        else:
            from datasets import DatasetDict, load_from_disk

            source = load_from_disk(str(path))
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
        items = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_table(path, split)
    elif isinstance(source, (list, tuple)):
        items = ((f"prompts[{i}]", row) for i, row in enumerate(source))
    else:
        items = _read_table(source, split)
    rows, skipped = [], []
    for where, raw in items:
        try:
            if isinstance(raw, Exception):
                raise raw
            rows.append(normalize_row(raw, prompt_key, answer_key))
        except ValueError as error:
            skipped.append(f"{where}: {error}")
    if not rows:
        detail = "; ".join(skipped[:3]) or "it is empty"
        raise ValueError(f"no usable prompt in {source if isinstance(source, (str, Path)) else 'the prompts'}: {detail}")
    return rows, skipped


# --- rewards -------------------------------------------------------------------------------------


def exact_match(completion: str, answer: Any) -> float:
    """1.0 if the final answer equals the reference answer, surrounding whitespace ignored."""
    return float(completion.strip() == str(answer).strip())


def contains_match(completion: str, answer: Any) -> float:
    """1.0 if the reference answer appears in the final answer."""
    return float(str(answer).strip() in completion)


def number_match(completion: str, answer: Any) -> float:
    """1.0 if the last number of the final answer equals the (numeric) reference answer (``tasks.last_number``)."""
    return float(last_number(completion) == float(answer))


def regex_match(pattern: str) -> Callable[..., float]:
    """A rule: the last match of ``pattern`` in the final answer (its first group, if it has one) must equal
    the reference answer; without a reference answer (None), any match scores 1.0 (a format reward)."""
    compiled = re.compile(pattern)

    def rule(completion: str, answer: Any) -> float:
        matches = list(compiled.finditer(completion))
        if not matches:
            return 0.0
        if answer is None:
            return 1.0
        last = matches[-1]
        found = last.group(1) if compiled.groups else last.group(0)
        return float((found or "").strip() == str(answer).strip())

    rule.__name__ = f"regex:{pattern}"
    return rule


RULES: dict[str, Callable[..., float]] = {"exact": exact_match, "contains": contains_match, "number": number_match}


def get_rule(spec: str) -> Callable[..., float]:
    """A built-in rule by name: ``exact``, ``contains``, ``number`` or ``regex:PATTERN``."""
    if spec.startswith("regex:"):
        return regex_match(spec.removeprefix("regex:"))
    if spec not in RULES:
        raise ValueError(f"unknown reward rule {spec!r}; built-in rules: {', '.join(RULES)}, regex:PATTERN")
    return RULES[spec]


def _argument_picker(fn: Callable, available: Sequence[str], what: str) -> Callable[[dict], dict]:
    """Check now that ``fn`` takes only names from ``available``; return a picker of its keyword arguments."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise TypeError(f"{what} {fn!r} has no inspectable signature") from None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return lambda values: values
    names = []
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) or (p.name not in available and p.default is p.empty):
            raise TypeError(f"{what} {_name(fn)!r}: cannot pass its parameter {p.name!r}; "
                            f"it may take any of {', '.join(available)} (by name)")
        if p.name in available:
            names.append(p.name)
    return lambda values: {name: values[name] for name in names}


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _as_reward(value: Any) -> float:
    """A reward function's return value as a finite float (bools, ints, numpy and torch scalars are fine)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"returned {number}, not a finite number")
    return number


def final_answer(messages: list[dict]) -> str:
    """The text of the last assistant message, or "" if there is none or it still calls a tool."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    if not replies or replies[-1].get("tool_calls") or "<tool_call>" in (replies[-1].get("content") or ""):
        return ""
    return replies[-1].get("content") or ""


def score_episode(rewards: list[tuple], episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
    """``sum(weight * fn(...))`` over ``rewards`` (``(name, fn, weight, picker)``); on any failure 0.0 and
    ``episode.info["reward_error"]`` (never a partial sum). Parts go to ``info["rewards"]`` when there are several."""
    values = {"completion": final_answer(messages), "answer": episode.answer, "messages": messages,
              "tool_calls": tool_calls, "row": episode.info.get("row", {}), "episode": episode}
    parts = {}
    for name, fn, _, pick in rewards:
        try:
            parts[name] = _as_reward(fn(**pick(values)))
        except Exception as error:  # a user's reward bug is recorded on the episode, not a crashed run
            episode.info["reward_error"] = f"reward function {name!r} raised {type(error).__name__}: {error}"
            return 0.0
    if len(parts) > 1:
        episode.info["rewards"] = parts
    return sum(weight * parts[name] for name, _, weight, _ in rewards)


# --- the tasks ------------------------------------------------------------------------------------


class DatasetTask:
    """A task whose episodes are the rows of a dataset (see the module docstring).

    Episode ``i`` plays row ``i % len(rows)``: in file order, or with ``shuffle`` in a new order every
    pass through the data (deterministic in the seed and the pass).
    """

    def __init__(self, prompts: Any, reward: Callable | str | Sequence[Callable | str], tools: Sequence[Callable] = (),
                 *, reward_weights: Sequence[float] | None = None, turn_reward: Callable | None = None,
                 system: str | None = None, name: str = "dataset", shuffle: bool = False,
                 prompt_key: str = "prompt", answer_key: str = "answer", split: str | None = None):
        self.name = name
        self.rows, self.skipped = load_prompts(prompts, prompt_key, answer_key, split)
        if self.skipped:
            warnings.warn(f"{len(self.skipped)} bad prompt rows skipped ({len(self.rows)} kept): "
                          + "; ".join(self.skipped[:5]) + (" ..." if len(self.skipped) > 5 else ""), stacklevel=2)
        specs = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        if not specs:
            raise ValueError("give at least one reward function or rule")
        functions = [get_rule(s) if isinstance(s, str) else s for s in specs]
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"a reward must be a callable or a rule name, got {fn!r}")
        weights = [1.0] * len(functions) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} reward_weights for {len(functions)} reward functions")
        names = [_name(fn) for fn in functions]
        names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.rewards = [(n, fn, w, _argument_picker(fn, REWARD_ARGUMENTS, "reward function"))
                        for n, fn, w in zip(names, functions, weights)]
        self.turn_reward = turn_reward
        self._turn_picker = turn_reward and _argument_picker(turn_reward, TURN_REWARD_ARGUMENTS, "turn reward")
        self.tools = [tool(fn) for fn in tools]
        self.system = system
        self.shuffle = shuffle
        if turn_reward is None:
            self.turn_rewards = None  # the loop asks for per-turn rewards only when this is callable

    def __len__(self) -> int:
        return len(self.rows)

    def row_index(self, index: int, seed: int = 0) -> int:
        """The row that episode ``index`` plays."""
        rounds, position = divmod(index, len(self.rows))
        if not self.shuffle:
            return position
        order = list(range(len(self.rows)))
        random.Random(f"{self.name}:{seed}:{rounds}").shuffle(order)
        return order[position]

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        row_index = self.row_index(index, seed)
        row = self.rows[row_index]
        messages = copy.deepcopy(row["messages"])
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return Episode(messages=messages, tools=list(self.tools), answer=row["answer"],
                       info={"row_index": row_index, "row": row["row"]})

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        """The weighted sum of the reward functions; 0.0 with ``info["reward_error"]`` if any of them fails."""
        return score_episode(self.rewards, episode, messages, tool_calls)

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float]:
        """One reward per assistant turn from ``turn_reward``; all 0.0 with ``info["turn_reward_error"]`` if it fails."""
        replies = [m for m in messages[len(episode.messages):] if m.get("role") == "assistant"]
        base = {"answer": episode.answer, "row": episode.info.get("row", {}), "messages": messages, "episode": episode}
        try:
            return [_as_reward(self.turn_reward(**self._turn_picker(
                {**base, "turn": turn, "message": message, "tool_calls": [c for c in tool_calls if c.turn == turn]}))) for turn, message in enumerate(replies)]
        except Exception as error:
            episode.info["turn_reward_error"] = f"turn reward {_name(self.turn_reward)!r} raised {type(error).__name__}: {error}"
            return [0.0] * len(replies)


class Environment:
    """Base class of a task generated by code: write ``sample`` (one row from a random generator) and ``score``.

    ``sample(rng)`` returns a row as a :class:`DatasetTask` reads it (a prompt string, or a dict with
    ``prompt`` and optionally ``answer`` and metadata); ``rng`` is a ``random.Random`` seeded by the
    episode's (index, seed), so episodes replay. ``score`` takes, by name, any of ``completion``,
    ``answer``, ``messages``, ``tool_calls``, ``row``, ``episode`` and returns the reward (a failure is
    recorded as ``info["reward_error"]`` with reward 0.0). ``tools`` are the tools of every episode;
    override ``episode_tools(row)`` for per-episode tools. ``name`` defaults to the class name.
    """

    name: str = ""
    tools: Sequence[Callable] = ()
    system: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = cls.__dict__.get("name") or cls.__name__
        for fn in cls.__dict__.get("tools", ()):
            tool(fn)  # a tool without a usable schema is an error when the class is defined

    @functools.cached_property
    def _rewards(self) -> list[tuple]:
        return [(type(self).__name__ + ".score", self.score, 1.0, _argument_picker(self.score, REWARD_ARGUMENTS, "score"))]

    def sample(self, rng: random.Random) -> dict | str:
        raise NotImplementedError(f"{type(self).__name__} must define sample(self, rng) -> row")

    def score(self, completion: str, answer: Any) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define score(self, completion, answer, ...) -> float")

    def episode_tools(self, row: dict) -> list[Callable]:
        return list(self.tools)

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        rng = random.Random(f"{self.name}:{seed}:{index}")
        raw = self.sample(rng)
        row = normalize_row(raw)
        messages = row["messages"]
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return Episode(messages=messages, tools=self.episode_tools(raw if isinstance(raw, dict) else {"prompt": raw}),
                       answer=row["answer"], info={"row": row["row"]})

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return score_episode(self._rewards, episode, messages, tool_calls)
