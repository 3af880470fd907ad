"""Prompt sources for GRPO: GSM8K, SimpleRL-Abel-Level3to5 and DAPO-Math-17K formats through
``datasets.load_dataset`` (a hub name for users, a local json/jsonl/parquet path for tests), and the
embedded offline generator of GSM8K-style problems (the default: no hub is needed).

Every source yields :class:`Example` (id, question, reference answer, and the row's chat messages
where its prompt comes as such). Rows with a missing or empty question or reference, and rows that
repeat an earlier one (the same prompt and reference), are skipped and counted, never a crash.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from specroll_mcore.config import DataConfig
from specroll_mcore.rl.rewards import reference_answer
from specroll_mcore.rl.synthetic import problems

Messages = tuple[tuple[str, str], ...]
"""Chat messages as (role, content) pairs."""


@dataclass(frozen=True)
class Example:
    id: int
    question: str
    """The question: a plain-text prompt, or the last user turn of the row's messages."""
    reference: str
    messages: Optional[Messages] = None
    """The row's own prompt, when the dataset gives it as chat messages (verl's parquet: DAPO-Math-17K,
    whose user turn asks for an 'Answer:' line): rendered as it is, instruction included."""


@dataclass
class LoadReport:
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def _messages(prompt: list) -> Messages:
    """A row's chat prompt -> (role, content) pairs; anything but messages with a string role and
    content makes the row malformed."""
    out = []
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"a prompt message must have a string role and content, got {m!r}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def _question_and_reference(row: dict[str, Any]) -> tuple[Optional[str], Optional[str], Optional[Messages]]:
    """Recognise the three formats by their columns."""
    if "prompt" in row and isinstance(row["prompt"], list):  # DAPO / verl parquet: chat messages
        messages = _messages(row["prompt"])
        users = [content for role, content in messages if role == "user"]
        ref = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
        return (users[-1] if users else None), ref, messages
    q = row.get("question") or row.get("problem") or (row.get("prompt") if isinstance(row.get("prompt"), str) else None)
    ref = row.get("answer") if row.get("answer") not in (None, "") else None  # GSM8K: "... #### 72"
    if ref is None:
        ref = row.get("gt_answer") or row.get("ground_truth") or row.get("solution")  # SimpleRL / MATH
    return q, ref, None


_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


def load_examples(source: str, split: str = "train", limit: Optional[int] = None, seed: int = 0,
                  name: Optional[str] = None, data_dir: Optional[str] = None) -> tuple[list[Example], LoadReport]:
    """``synthetic`` (the offline generator), a local json/jsonl/parquet file (all of it, whatever
    ``split``), a local directory (a local copy of a dataset: the files of ``split``, found as
    ``datasets`` finds them: ``train.parquet`` and ``test.parquet``, ``main/train-*``, folders
    ``train/``; files named after no split are all ``train``), or a hub dataset name (with ``name``
    its configuration, e.g. ``openai/gsm8k`` + ``main``). ``data_dir``: one folder of a dataset that
    keeps its subsets in folders (``datasets.load_dataset``'s: ``simplelr_abel_level3to5`` of
    ``hkust-nlp/SimpleRL-Zoo-Data``), for a local directory the folder under it. The synthetic
    source's ``train`` split is generated from ``seed``, any other split from a seed of its own (the
    same questions can still come up in both, rarely: the trainer leaves those out of evaluation)."""
    report = LoadReport()
    if source == "synthetic":
        n = limit or 1024
        if split != "train":
            seed = seed * 1_000_003 + zlib.crc32(split.encode())
        out = [Example(i, p.question, p.gsm8k_answer) for i, p in enumerate(problems(n, seed=seed, max_level=4))]
        report.kept = len(out)
        return out, report
    import datasets

    path = Path(source)
    if not path.exists() and (path.is_absolute() or source.startswith(".") or path.suffix in _LOCAL_SUFFIXES):
        raise FileNotFoundError(f"data.source {source!r}: no such file or directory; give an existing "
                                f"{'/'.join(_LOCAL_SUFFIXES)} file or directory, a hub dataset name, or 'synthetic'")
    if path.is_file():
        if data_dir:
            raise ValueError(f"data.data_dir {data_dir!r} names a folder inside a dataset, but data.source "
                             f"{source!r} is a file; give the dataset's directory as the source")
        ds = datasets.load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files=[str(path)],
                                   split="train")
    elif path.is_dir():  # its files by split, as `datasets` finds them (train.parquet, test-*.jsonl, train/...)
        folder = path / data_dir if data_dir else path
        if data_dir and not folder.is_dir():
            raise FileNotFoundError(f"data.data_dir {data_dir!r}: no such folder under {source}")
        if not any(p.suffix in _LOCAL_SUFFIXES for p in folder.rglob("*")):
            raise FileNotFoundError(f"no {'/'.join(_LOCAL_SUFFIXES)} files under {folder}")
        splits = datasets.load_dataset(str(path), name, data_dir=data_dir)
        if split not in splits:
            raise ValueError(f"data.source {source!r} has no {split!r} split, only {sorted(splits)}: name its files "
                             f"by split (train.parquet, test.parquet, or folders train/ and test/), or give the file")
        ds = splits[split]
    else:
        ds = datasets.load_dataset(source, name, split=split, data_dir=data_dir)
    out: list[Example] = []
    seen: set[tuple[Any, str]] = set()
    for i, row in enumerate(ds):
        if limit is not None and len(out) >= limit:
            break
        try:
            q, ref, messages = _question_and_reference(dict(row))
        except Exception:  # noqa: BLE001  (a malformed row is skipped and counted)
            report.skip("malformed row")
            continue
        if not q or not isinstance(q, str):
            report.skip("missing question")
            continue
        if isinstance(ref, (list, tuple)):  # verl's ground_truth may be a list: ["72"]
            if len(ref) > 1:  # (math-verify would read ["1/2", "0.5"] as an interval)
                report.skip("several reference answers")
                continue
            ref = ref[0] if ref else None
        if reference_answer(ref) is None:  # (none, blank, or a GSM8K answer with nothing after its '####')
            report.skip("missing reference answer")
            continue
        key = (messages or q.strip(), str(ref))
        if key in seen:  # (the same prompt and reference again: once an epoch is enough)
            report.skip("duplicate row")
            continue
        seen.add(key)
        out.append(Example(i, q.strip(), str(ref), messages))
    report.kept = len(out)
    return out, report


def load_data(data: DataConfig, seed: int) -> tuple[list[Example], LoadReport]:
    """:func:`load_examples` of ``data``'s source, split, limit, configuration and folder."""
    return load_examples(data.source, data.split, data.limit, seed, data.name, data.data_dir)


def chat_prompt_ids(tokenizer: Any, text: str, template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
    """Token ids of one user turn in the tokenizer's chat template, plus the generation prompt;
    ``template_kwargs``: variables the template reads (DataConfig.chat_template_kwargs)."""
    return chat_ids(tokenizer, (("user", text),), template_kwargs)


def chat_ids(tokenizer: Any, messages: Messages, template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
    """Token ids of chat messages in the tokenizer's chat template, plus the generation prompt."""
    enc = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                        **(template_kwargs or {}))
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)  # transformers 5 returns an encoding


def synthetic_chat_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    """``n`` questions of the offline GSM8K-style generator as chat prompts (what the rollout
    benchmarks feed both engines)."""
    return [chat_prompt_ids(tokenizer, p.question) for p in problems(n, seed=seed)]


def render_prompt(tokenizer: Any, example: Example, data: Optional[DataConfig] = None) -> list[int]:
    """Token ids of a GRPO prompt: the row's own chat messages as they are, or its question with
    ``data.instruction`` on a line of its own as one user turn; in the chat template (``data.chat``,
    where the tokenizer has one), else as plain text (the messages' contents one after the other,
    a blank line apart); ``data`` None: :class:`DataConfig`'s defaults."""
    data = data or DataConfig()
    messages = example.messages
    if messages is None:
        text = f"{example.question}\n{data.instruction}" if data.instruction else example.question
        messages = (("user", text),)
    if data.chat and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, messages, data.chat_template_kwargs)
    return list(tokenizer("\n\n".join(content for _, content in messages))["input_ids"])
