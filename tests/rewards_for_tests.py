"""A deterministic reward for loop-mechanics tests on random models (math answers never come out of
them): a pure function of the response tokens, varied enough to give non-zero advantages."""


def token_parity_reward(text, reference, tokens):
    r = (sum(tokens) % 7) / 6.0
    return r, r > 0.5


def flat_for_even_answers_reward(text, reference, tokens):
    """The same reward for every response to a prompt whose reference answer ends in an even digit (a
    group without a learning signal, which dynamic sampling leaves out), token parity otherwise."""
    digits = [ch for ch in str(reference).split("####")[-1] if ch.isdigit()]
    if digits and int(digits[-1]) % 2 == 0:
        return 0.5, False
    return token_parity_reward(text, reference, tokens)


def constant_reward(text, reference, tokens):
    """Every response the same reward: no group has a learning signal."""
    return 0.5, False
