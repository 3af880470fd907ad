"""An offline, seeded generator of GSM8K-style multi-step arithmetic word problems.

No dataset hub is reachable on every machine, so this is the embedded default data source. Each
problem has a verifiable integer answer and a difficulty level (the number of arithmetic steps);
answers are given GSM8K-style ("#### n").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_NAMES = ["Natalia", "Omar", "Priya", "Lena", "Kofi", "Mateo", "Yuki", "Sara", "Ivan", "Amara"]
_ITEMS = ["apples", "stickers", "books", "marbles", "cookies", "pencils", "stamps", "shells"]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    level: int
    solution: str = ""
    """A worked solution, one equation per step, ending in the GSM8K answer line."""

    @property
    def gsm8k_answer(self) -> str:
        return f"#### {self.answer}"


def _step(rng: random.Random, total: int, name: str, item: str) -> tuple[str, int, str]:
    """One step: its text, the new total and the equation that gets there."""
    kind = rng.choice(["buy", "give", "double", "share"] if total % 2 == 0 else ["buy", "give", "triple"])
    if kind == "buy":
        n = rng.randint(2, 30)
        return f"Then {name} buys {n} more {item}.", total + n, f"{total} + {n} = {total + n}"
    if kind == "give" and total > 2:
        n = rng.randint(1, total - 1)
        return f"Then {name} gives away {n} {item}.", total - n, f"{total} - {n} = {total - n}"
    if kind == "double":
        return f"Then the number of {item} doubles.", total * 2, f"{total} * 2 = {total * 2}"
    if kind == "triple":
        return f"Then the number of {item} triples.", total * 3, f"{total} * 3 = {total * 3}"
    if kind == "share":
        return f"Then {name} gives half of the {item} to a friend.", total // 2, f"{total} / 2 = {total // 2}"
    n = rng.randint(2, 9)
    return f"Then {name} buys {n} more {item}.", total + n, f"{total} + {n} = {total + n}"


def make_problem(seed: int, index: int, level: int) -> Problem:
    """Problem ``index`` of a seeded stream, with ``level`` steps after the start (1..6)."""
    rng = random.Random(seed * 1_000_003 + index)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(3, 60)
    parts = [f"{name} has {total} {item}."]
    work = [f"{name} starts with {total} {item}."]
    for _ in range(level):
        text, total, equation = _step(rng, total, name, item)
        parts.append(text)
        work.append(f"{equation}.")
    parts.append(f"How many {item} does {name} have now?")
    work.append(f"#### {total}")
    return Problem(" ".join(parts), total, level, "\n".join(work))


def problems(n: int, seed: int = 0, min_level: int = 1, max_level: int = 4) -> list[Problem]:
    """``n`` problems with levels cycling from min_level to max_level."""
    if not 1 <= min_level <= max_level:
        raise ValueError(f"need 1 <= min_level <= max_level, got {min_level}, {max_level}")
    span = max_level - min_level + 1
    return [make_problem(seed, i, min_level + i % span) for i in range(n)]
