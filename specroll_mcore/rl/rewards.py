"""Verifiable rewards: answer checking with math-verify (the checker TRL and verl use).

References may be GSM8K-style ("... #### 72"), a \\boxed{} expression, or a bare answer. The
response's answer is what math-verify extracts from it (\\boxed{...} first, then a stated answer
such as an 'Answer:' line, then the last expression), in what follows the thinking of a reasoning
model (:func:`final_part`). An optional format reward pays for giving the answer in the asked form,
and DAPO's soft overlong punishment (:func:`overlong_penalty`) takes reward from responses near the
length limit.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

_GSM8K = re.compile(r"####\s*(.*?)\s*$", re.S)
_ANSWER_LINE = re.compile(r"^[ \t*]*answer[ \t*]*:", re.I | re.M)  # DAPO-Math-17K's "Answer: $Answer"


def reference_answer(reference: Optional[str]) -> Optional[str]:
    """The answer part of a reference: after '####' for GSM8K (thousands separators dropped), else
    the whole string; None if that is empty (a GSM8K reference with nothing after its '####' too)."""
    if reference is None:
        return None
    text = str(reference).strip()
    m = _GSM8K.search(text)
    if m:
        text = m.group(1).strip().replace(",", "")
    return text or None


def parse_reference(reference: Optional[str]) -> list:
    """math-verify's parse of a reference's answer: what responses are checked against; empty where
    there is nothing to check against (no answer, or one math-verify extracts nothing from, as an
    empty ``\\boxed{}``). Cached by answer: the data loaders parse every reference once, and each
    of a prompt's responses is scored against the same one."""
    ref = reference_answer(reference)
    return [] if ref is None else list(_parse_answer(ref))


@functools.lru_cache(maxsize=65536)
def _parse_answer(ref: str) -> tuple:
    from math_verify import parse

    return tuple(parse(ref if ("\\" in ref or "$" in ref) else f"${ref}$"))


@dataclass(frozen=True)
class RewardConfig:
    format_reward: float = 0.0
    """Added when the response states its answer in one of the forms the prompts ask for: \\boxed{},
    '####' (the embedded data's and GSM8K's) or a line starting 'Answer:' (DAPO-Math-17K's)."""


def score(response: str, reference: str, cfg: RewardConfig = RewardConfig(), thinking: bool = False
          ) -> tuple[float, bool]:
    """(reward, correct). Correctness is 1.0; the format reward, if any, is added on top. A reference
    :func:`parse_reference` finds nothing in is refused (the data loaders skip those rows).
    ``thinking``: the prompt left a ``<think>`` block open (see :func:`final_part`)."""
    from math_verify import parse, verify

    gold = parse_reference(reference)
    if not gold:
        raise ValueError(f"reference answer {reference!r} holds nothing math-verify can check a response against")
    response = final_part(response, thinking)
    text = response
    m = _GSM8K.search(response)
    if m:  # a GSM8K-style final line wins over earlier numbers
        text = m.group(1)
    answer = parse(text) if text else []
    correct = bool(answer) and bool(verify(gold, answer))
    formatted = "\\boxed{" in response or "####" in response or _ANSWER_LINE.search(response) is not None
    return float(correct) + (cfg.format_reward if formatted else 0.0), correct


def final_part(response: str, thinking: bool = False) -> str:
    """What a reasoning model answers after its thinking: the text after the last ``</think>``; ""
    when a ``<think>`` block never closes (cut off while thinking: no answer yet, whatever numbers it
    tried); the whole response when it has no thinking block. ``thinking``: the block was opened by
    the prompt (chat templates of thinking-only models end with ``<think>``), so the response starts
    inside it. (Tentative \\boxed{} answers would otherwise count: math-verify reads two boxed
    answers as the set of both.)"""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    return "" if thinking or "<think>" in response else response


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt ends inside a ``<think>`` block (its last ``<think>`` after its last ``</think>``)."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment, added to a response's reward: 0 up to ``max_length - buffer``
    tokens, then falling linearly to ``-factor`` at ``max_length`` (``buffer`` 0: never)."""
    if buffer <= 0:
        return 0.0
    excess = length - (max_length - buffer)
    return -factor * min(excess, buffer) / buffer if excess > 0 else 0.0
