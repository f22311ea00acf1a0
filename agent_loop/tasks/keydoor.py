"""``keydoor``: walk to a key, then to a door, one ``move`` per turn (issue 47 item 5: a task where credit per turn
can matter).

A 4x4 grid of rooms (row 1 at the top, column 1 at the left); the agent starts in one room, the key lies in
another, the door in a third. Tools: ``move(direction)`` (``up``, ``down``, ``left``, ``right``: one room) and
``look()`` (where you are, nothing changes). Every observation is the description of the state the call left,
a pure function of that state, so identical states read identically across the episodes of a group (the anchor
states of GiGPO):

- without the key: "You are at row 3, column 1. The key is 2 up and 1 right." (in the door's room: "The door is
  here, but locked." before the key's offset);
- with the key: "You are at row 1, column 2. You have the key. The door is 3 down.";
- in the door's room with the key: "You are at row 4, column 2. You opened the door.".

Offsets name the vertical part first. A move into a wall, an unknown direction, or a move after the door opened
raises (the loop's error observation; the state does not change). Tools are ``async`` and never await: the calls
of one turn run one after the other in call order, so the rewards below, which replay the calls in that order
from the map, see exactly the states the model saw.

Rewards (:func:`replay` of the recorded calls on the episode's map):

- outcome (``reward``): 1.0 if the calls opened the door and the last assistant message is a final answer (no
  tool call), else 0.0; ``success``: reward > 0;
- per turn (``turn_rewards``, one per assistant turn, on its last ASSISTANT token): the sum over the turn's calls
  of +0.1 for a move that brings the agent closer to done (fewer moves left: key distance plus key-to-door
  distance before the key, door distance after), -0.1 for any other call that fails or a move that does not
  (``look``: 0); a turn without calls 0;
- ``turn_states``: the state each turn started from, ``(row, column, has_key, opened)``.

An ideal episode is 3 to 5 moves and "Done." (maps are those with 3 to 5 moves from start via the key to the
door); play it with ``max_turns`` 8 or more (:data:`MAX_TURNS`: room for a mistake, which costs two moves).
Held-out split: the maps whose stable hash is 0 mod 5 are held out; episodes of a ``seed`` at or above
:data:`HELD_OUT_SEED` (train's evaluation stream, ``seed + 1_000_003``) draw only from them, every other seed
never. Demonstrations (``agent-loop warmstart --task keydoor``): the moves that follow each observation's first
named direction, then "Done.".
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Callable, NamedTuple

from agent_loop.episode.contracts import Task, episode_rng
from agent_loop.tasks.rewards import final_answer
from agent_loop.types import Episode, ToolCallRecord

SIZE = 4  # rooms per side
MOVES = (3, 5)  # an ideal episode's moves, fewest and most
MAX_TURNS = 8  # turns to play an episode with: the most moves, the answer, and two turns for one mistake
HELD_OUT_SEED = 1_000_000  # seeds from here on play the held-out maps
HELD_OUT_SHARE = 5  # one map in 5 is held out
STEP_REWARD = 0.1  # per call: + for a move closer to done, - for a failed call or a move that is not
DIRECTIONS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

Cell = tuple[int, int]  # (row, column), 1-based


class State(NamedTuple):
    """Where the agent is, whether it holds the key, whether the door is open."""

    row: int
    column: int
    has_key: bool = False
    opened: bool = False

    @property
    def cell(self) -> Cell:
        return self.row, self.column


@dataclass(frozen=True)
class Map:
    """One episode's rooms: the start, the key's and the door's."""

    start: Cell
    key: Cell
    door: Cell

    @property
    def start_state(self) -> State:
        return State(*self.start)

    @property
    def moves(self) -> int:
        """The fewest moves from the start via the key to the door."""
        return distance(self.start, self.key) + distance(self.key, self.door)

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(f"keydoor:{self.start}:{self.key}:{self.door}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0

    @classmethod
    def from_info(cls, info: dict) -> Map:
        return cls(tuple(info["start"]), tuple(info["key"]), tuple(info["door"]))


def distance(a: Cell, b: Cell) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


@functools.cache
def maps(held_out: bool) -> tuple[Map, ...]:
    """Every map of :data:`MOVES` moves (start, key and door distinct) in the training or the held-out split."""
    cells = [(r, c) for r in range(1, SIZE + 1) for c in range(1, SIZE + 1)]
    every = (Map(*cells3) for cells3 in itertools.permutations(cells, 3))
    return tuple(m for m in every if MOVES[0] <= m.moves <= MOVES[1] and m.held_out == held_out)


def moves_left(world: Map, state: State) -> int:
    """The fewest moves to done from ``state`` (0 once the door is open)."""
    if state.opened:
        return 0
    if state.has_key:
        return distance(state.cell, world.door)
    return distance(state.cell, world.key) + distance(world.key, world.door)


def offset(a: Cell, b: Cell) -> str:
    """Where ``b`` lies from ``a``: "2 up and 1 right" (the vertical part first; a zero part left out)."""
    rows, columns = b[0] - a[0], b[1] - a[1]
    parts = ([f"{abs(rows)} {'up' if rows < 0 else 'down'}"] if rows else []) + \
            ([f"{abs(columns)} {'left' if columns < 0 else 'right'}"] if columns else [])
    return " and ".join(parts)


def describe(world: Map, state: State) -> str:
    """The observation of ``state``: a pure function of it (equal states read the same)."""
    here = f"You are at row {state.row}, column {state.column}."
    if state.opened:
        return f"{here} You opened the door."
    if state.has_key:
        return f"{here} You have the key. The door is {offset(state.cell, world.door)}."
    locked = " The door is here, but locked." if state.cell == world.door else ""
    return f"{here}{locked} The key is {offset(state.cell, world.key)}."


def advance(world: Map, state: State, direction) -> State:
    """The state after a move; ValueError (the model's error observation) for an unknown direction, a wall, or a
    move after the door opened."""
    if not isinstance(direction, str) or direction.strip().lower() not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; use up, down, left or right")
    if state.opened:
        raise ValueError('the door is already open; say "Done."')
    d_row, d_column = DIRECTIONS[direction.strip().lower()]
    row, column = state.row + d_row, state.column + d_column
    if not (1 <= row <= SIZE and 1 <= column <= SIZE):
        raise ValueError(f"a wall: you cannot move {direction.strip().lower()} from row {state.row}, column {state.column}")
    has_key = state.has_key or (row, column) == world.key
    return State(row, column, has_key, has_key and (row, column) == world.door)


def make_tools(world: Map) -> list[Callable]:
    """``move`` and ``look`` over one episode's world (its state lives in the closure)."""
    state = [world.start_state]

    async def move(direction: str) -> str:
        """Move one room up, down, left or right.

        Args:
            direction: up, down, left or right.
        """
        state[0] = advance(world, state[0], direction)  # raises before changing anything
        return describe(world, state[0])

    async def look() -> str:
        """Describe where you are and where the key or the door is; nothing changes."""
        return describe(world, state[0])

    return [move, look]


class Step(NamedTuple):
    """One recorded call replayed: its turn, the state before and after, and its value (per-turn reward share)."""

    turn: int
    before: State
    after: State
    value: float


def replay(world: Map, tool_calls: list[ToolCallRecord]) -> list[Step]:
    """The recorded calls replayed on ``world`` in call order (the order the tools ran them): a failed call
    changes nothing and is worth -STEP_REWARD; ``look`` 0; a move +STEP_REWARD if it leaves fewer moves to
    done, else -STEP_REWARD."""
    state, steps = world.start_state, []
    for call in tool_calls:
        after, value = state, -STEP_REWARD
        if call.error_kind is None and call.name == "look":
            value = 0.0
        elif call.error_kind is None and call.name == "move":
            after = advance(world, state, call.arguments.get("direction"))
            value = STEP_REWARD if moves_left(world, after) < moves_left(world, state) else -STEP_REWARD
        steps.append(Step(call.turn, state, after, value))
        state = after
    return steps


def assistant_turns(messages: list[dict]) -> int:
    return sum(m.get("role") == "assistant" for m in messages)


def ideal_directions(world: Map) -> list[str]:
    """The demonstrated moves: each time, the first direction the observation names."""
    state, directions = world.start_state, []
    while not state.opened:
        target = world.door if state.has_key else world.key
        rows, columns = target[0] - state.row, target[1] - state.column
        direction = ("up" if rows < 0 else "down") if rows else ("left" if columns < 0 else "right")
        state = advance(world, state, direction)
        directions.append(direction)
    return directions


class KeyDoorTask(Task):
    """Key and door in a 4x4 grid with ``move``/``look`` tools, per-turn rewards and per-turn states (module doc)."""

    name = "keydoor"

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        held_out = seed >= HELD_OUT_SEED
        world = episode_rng(self.name, seed, index).choice(maps(held_out))
        question = (f"A {SIZE}x{SIZE} grid of rooms, row 1 at the top, column 1 at the left. "
                    f"{describe(world, world.start_state)} Walk into the key's room, then into the door's room, one "
                    'move per call; then say "Done."')
        return Episode(
            messages=[{"role": "user", "content": question}],
            tools=make_tools(world),
            answer="Done.",
            info={"task": self.name, "index": index, "seed": seed, "start": list(world.start), "key": list(world.key),
                  "door": list(world.door), "moves": world.moves, "split": "held_out" if held_out else "train"},
        )

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        steps = replay(Map.from_info(episode.info), tool_calls)
        opened = bool(steps) and steps[-1].after.opened
        return float(opened and bool(final_answer(messages, episode.tool_format).strip()))

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float]:
        rewards = [0.0] * assistant_turns(messages)
        for step in replay(Map.from_info(episode.info), tool_calls):
            rewards[step.turn] += step.value
        return [round(r, 10) for r in rewards]

    def turn_states(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[tuple]:
        """``(row, column, has_key, opened)`` (ints) of the state each assistant turn started from."""
        world = Map.from_info(episode.info)
        steps = replay(world, tool_calls)
        states, state = [], world.start_state
        for turn in range(assistant_turns(messages)):
            states.append((state.row, state.column, int(state.has_key), int(state.opened)))
            state = next((s.after for s in reversed(steps) if s.turn == turn), state)
        return states

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict:
        """``got_key``, ``opened`` (0/1) and ``good_moves``: the share of calls that brought the agent closer."""
        steps = replay(Map.from_info(episode.info), tool_calls)
        last = steps[-1].after if steps else Map.from_info(episode.info).start_state
        good = sum(s.value > 0 for s in steps) / len(steps) if steps else 0.0
        return {"got_key": float(last.has_key), "opened": float(last.opened), "good_moves": good}

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict]:
        """The moves along each observation's first named direction, then "Done."."""
        turns = [{"role": "assistant", "content": "", "tool_calls": [{"name": "move", "arguments": {"direction": d}}]}
                 for d in ideal_directions(Map.from_info(episode.info))]
        return turns + [{"role": "assistant", "content": "Done."}]
