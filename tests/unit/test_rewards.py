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
