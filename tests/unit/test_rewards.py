"""The verifiable reward (math-verify's answer check) against hand-judged responses."""

import pytest

from specroll_mcore.rl.rewards import RewardConfig, parse_reference, reference_answer, score

FORMAT = RewardConfig(format_reward=0.1)


@pytest.mark.parametrize("response, reference, reward, formatted_reward", [
    # GSM8K: the reference's answer follows '####'; so does the response's, when it gives one
    ("She has 3 + 4 = 7 apples. #### 7", "Natalia has 3 + 4 = 7. #### 7", 1.0, 1.1),
    ("3 + 4 = 7, so 7 apples. #### 9", "#### 7", 0.0, 0.1),  # the '####' line wins over earlier numbers
    ("3 + 4 = 7, so 7 apples. #### 9", "#### 9", 1.0, 1.1),
    ("The total is 1000", "#### 1,000", 1.0, 1.0),  # thousands separators; no format reward without a form
    ("The total is 1,000 dollars. #### 1,000", "#### 1,000", 1.0, 1.1),
    ("I think it is 72.", "#### 72", 1.0, 1.0),  # no form: the last expression
    ("no idea", "#### 72", 0.0, 0.0),
    # \boxed{} answers, checked as mathematics, not as text
    ("so the answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, 1.1),
    ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.1),
    ("\\boxed{72}", "72", 1.0, 1.1),
    ("\\boxed{73}", "72", 0.0, 0.1),
    # DAPO-Math-17K's prompts ask for a last line "Answer: $Answer"; math-verify reads a stated answer first
    ("2 + 2 = 4, and twice that is 8.\nAnswer: 4", "4", 1.0, 1.1),
    ("**Answer:** 20", "#### 24", 0.0, 0.1),
    ("so the answer: 4", "4", 1.0, 1.0),  # in a sentence: not the asked form
    # a reasoning model: what follows its thinking (math-verify reads two \boxed{} as the set of both)
    ("<think>Maybe \\boxed{3}? No: 2 + 3 = 5.</think>\n\nSo \\boxed{5}", "5", 1.0, 1.1),
    ("<think>Maybe \\boxed{5}, let me check 2 + 3", "5", 0.0, 0.0),  # cut off while thinking: no answer
    ("2 + 3 = 5</think>\n\n#### 5", "5", 1.0, 1.1),  # (a template that opens the block in the prompt)
    ("<think>It is \\boxed{5}.</think>", "5", 0.0, 0.0),
])
def test_score(response, reference, reward, formatted_reward):
    assert score(response, reference) == (reward, reward == 1.0)
    assert score(response, reference, FORMAT) == (pytest.approx(formatted_reward), reward == 1.0)


def test_reference_answers():
    assert reference_answer("She sold 1,234 clips. #### 1,234") == "1234"
    assert reference_answer("  \\frac{1}{2} ") == "\\frac{1}{2}"
    for missing in (None, "", "   ", "####", "She sold them all. ####  "):
        assert reference_answer(missing) is None, missing
        assert parse_reference(missing) == []
    assert parse_reference("\\boxed{}") == []  # an answer math-verify extracts nothing from
    assert parse_reference("#### 72")


def test_a_reference_with_nothing_to_check_against_is_refused():
    for bad in ("\\boxed{}", "####"):
        with pytest.raises(ValueError, match="holds nothing math-verify can check a response against"):
            score("\\boxed{1}", bad)


def test_dataset_files_in_their_published_layouts(tmp_path):
    """DAPO-Math-17K as verl's parquet (chat messages, the answer under reward_model), GSM8K's parquet
    (question / answer), and SimpleRL's json (question / gt_answer) in one directory: the questions and
    references the rewards then check."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specroll_mcore.rl.data import load_examples

    dapo = [{"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": f"d{i}"},
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer: $Answer"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"}} for i in (1, 2)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(dapo), tmp_path / "data" / "a_dapo.parquet")
    gsm8k = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]
    pq.write_table(pa.Table.from_pylist(gsm8k), tmp_path / "data" / "b_gsm8k.parquet")
    examples, report = load_examples(str(tmp_path / "data" / "a_dapo.parquet"))
    assert [(e.question, e.reference) for e in examples] == [("What is 1 + 1? Answer: $Answer", "2"),
                                                             ("What is 2 + 2? Answer: $Answer", "4")]
    assert report.kept == 2 and not report.skipped
    assert score("2 + 2 = 4\nAnswer: 4", examples[1].reference) == (1.0, True)
    listed = [{"prompt": row["prompt"], "reward_model": {"ground_truth": answers}}  # verl's ground truth as a list
              for row, answers in zip(dapo, (["2"], ["1/2", "0.5"]))]
    pq.write_table(pa.Table.from_pylist(listed), tmp_path / "listed.parquet")
    examples, report = load_examples(str(tmp_path / "listed.parquet"))  # several: not read as one (an interval)
    assert [e.reference for e in examples] == ["2"] and report.skipped == {"several reference answers": 1}
    examples, _ = load_examples(str(tmp_path / "data" / "b_gsm8k.parquet"))
    assert examples[0].question.startswith("Tom has") and score("3 + 4 = 7 #### 7", examples[0].reference)[1]
    (tmp_path / "simplerl.json").write_text('[{"question": "Simplify 2/4.", "gt_answer": "\\\\frac{1}{2}"}]')
    examples, _ = load_examples(str(tmp_path / "simplerl.json"))
    assert score("It is \\boxed{0.5}", examples[0].reference) == (1.0, True)


def test_prompts_are_rendered_as_the_dataset_gives_them(tmp_path):
    """A row whose prompt is a list of chat messages (verl's parquet: DAPO-Math-17K, whose user turn asks
    for an 'Answer:' line) is rendered as it is, its system message included and nothing appended; a
    plain question gets DataConfig.instruction on a line of its own ("" appends nothing). A message
    without a string role and content makes its row malformed, and a row repeating an earlier one is
    a duplicate: both skipped and counted."""
    import json

    import transformers

    from grpo_fixtures import _smollm2_tokenizer_files
    from specroll_mcore.config import DataConfig
    from specroll_mcore.rl.data import load_examples, render_prompt

    dapo = "Solve step by step. The last line of your response should be of the form Answer: $Answer.\n\nWhat is 2 + 2?"
    rows = [{"prompt": [{"role": "system", "content": "You are a careful mathematician."},
                        {"role": "user", "content": dapo}], "reward_model": {"ground_truth": "4"}},
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "4"}},
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"}]
    rows += rows[:1] + rows[-1:]  # (a dataset published with its rows repeated: each once)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    examples, report = load_examples(str(tmp_path / "rows.jsonl"))
    assert report.skipped == {"malformed row": 1, "duplicate row": 2} and report.kept == 2
    chat, plain = examples
    assert chat.question == dapo and chat.messages == (("system", "You are a careful mathematician."), ("user", dapo))
    assert plain.messages is None

    tok = transformers.AutoTokenizer.from_pretrained(_smollm2_tokenizer_files())

    def template(*messages):
        return tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                       tokenize=False)

    def text(ids):
        return tok.decode(ids)

    assert text(render_prompt(tok, chat)) == template(*chat.messages)  # no '####' instruction against DAPO's
    question = "Tom has 3 apples and buys 4. How many?"
    assert text(render_prompt(tok, plain)) == template(("user", f"{question}\n{DataConfig().instruction}"))
    assert "'####'" in DataConfig().instruction
    boxed = DataConfig(instruction="Put your final answer within \\boxed{}.")
    assert text(render_prompt(tok, plain, boxed)) == template(("user", f"{question}\n{boxed.instruction}"))
    assert text(render_prompt(tok, plain, DataConfig(instruction=""))) == template(("user", question))
    # without the chat template: the messages' contents a blank line apart
    raw = DataConfig(chat=False)
    assert text(render_prompt(tok, chat, raw)) == f"You are a careful mathematician.\n\n{dapo}"
    assert text(render_prompt(tok, plain, raw)) == f"{question}\n{raw.instruction}"


def test_a_local_copy_of_a_dataset_is_read_by_split_and_folder(tmp_path):
    """A local directory is read as `datasets` reads a dataset: the files of the asked split (a copy of
    GSM8K's train and test files must not train on the test problems), one subset folder with
    data_dir (SimpleRL-Zoo-Data keeps its subsets in folders); files named after no split are train."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specroll_mcore.config import DataConfig
    from specroll_mcore.rl.data import load_examples

    for subset in ("simplelr_abel_level3to5", "simplelr_qwen_level3to5"):
        (tmp_path / "zoo" / subset).mkdir(parents=True)
        for split in ("train", "test"):
            rows = [{"question": f"{subset} {split} {i}: what is {i} + 1?", "gt_answer": str(i + 1)} for i in range(3)]
            pq.write_table(pa.Table.from_pylist(rows), tmp_path / "zoo" / subset / f"{split}.parquet")
    zoo = str(tmp_path / "zoo")

    def questions(*args, **kwargs):
        return [e.question.split(":")[0] for e in load_examples(zoo, *args, **kwargs)[0]]

    abel = "simplelr_abel_level3to5"
    assert questions("test", data_dir=abel) == [f"{abel} test {i}" for i in range(3)]
    assert questions(data_dir=abel) == [f"{abel} train {i}" for i in range(3)]
    assert len(questions()) == 6 and all(" train " in q for q in questions())  # both subsets' train files
    with pytest.raises(FileNotFoundError, match=r"data.data_dir 'simplelr_abel': no such folder under .*zoo"):
        load_examples(zoo, data_dir="simplelr_abel")

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "problems.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n')
    assert [e.reference for e in load_examples(str(tmp_path / "mine"))[0]] == ["#### 2"]
    with pytest.raises(ValueError, match=r"data.source '.*mine' has no 'test' split, only \['train'\]: name its "
                                         r"files by split"):
        load_examples(str(tmp_path / "mine"), "test")
    with pytest.raises(ValueError, match=r"data.data_dir 'x' names a folder inside a dataset, but data.source .* is "
                                         r"a file; give the dataset's directory"):
        load_examples(str(tmp_path / "mine" / "problems.jsonl"), data_dir="x")
    with pytest.raises(ValueError, match=r"DataConfig.data_dir \('x'\) names a folder of a dataset; the synthetic"):
        DataConfig(data_dir="x")


def test_a_prompt_that_opens_the_thinking_block_is_scored_after_it():
    """Chat templates of thinking-only models end the prompt with "<think>": the response starts inside
    the block, so a response cut off before its "</think>" has no answer yet (whatever it boxed), and
    one that closes it is scored on what follows. The scorer reads that from the prompt's last tokens;
    a prompt that closes an empty block (Qwen3 with enable_thinking false) or opens none changes nothing."""
    import transformers

    from grpo_fixtures import _smollm2_tokenizer_files
    from specroll_mcore.config import TrainConfig
    from specroll_mcore.rl.evaluation import make_scorer
    from specroll_mcore.rl.rewards import opens_thinking

    assert score("2 + 3 = 5, so \\boxed{5}", "5", thinking=True) == (0.0, False)  # cut off while thinking
    assert score("2 + 3 = 5</think>\n\\boxed{5}", "5", thinking=True) == (1.0, True)
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not opens_thinking("assistant\n")
    tok = transformers.AutoTokenizer.from_pretrained(_smollm2_tokenizer_files())
    scorer = make_scorer(TrainConfig(), tok)
    response = tok("2 + 3 = 5, so \\boxed{5}", add_special_tokens=False)["input_ids"]
    head = tok("A long question about sums.\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    opened = head + tok("<think>\n", add_special_tokens=False)["input_ids"]
    closed = opened + tok("\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert scorer(response, "5", head) == scorer(response, "5", closed) == (1.0, True)
    assert scorer(response, "5", opened) == (0.0, False)
