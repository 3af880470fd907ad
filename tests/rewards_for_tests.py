"""A deterministic reward for loop-mechanics tests on random models (math answers never come out of
them): a pure function of the response tokens, varied enough to give non-zero advantages."""


def token_parity_reward(text, reference, tokens):
    r = (sum(tokens) % 7) / 6.0
    return r, r > 0.5
