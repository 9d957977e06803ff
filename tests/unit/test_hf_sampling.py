"""The transformers engine's sampler: vLLM's processed distribution (temperature, top-k,
top-p), the log-prob of the token drawn under it, greedy at temperature 0."""

import math

import torch

from generators.hf_engine import sample_processed
from generators.interface import Sampling

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # most likely: 1, then 3, 2, 0


def _draws(how: Sampling, n: int = 2000):
    rng = torch.Generator().manual_seed(0)
    tok, lp = sample_processed(PROBS.log().expand(n, -1).clone(), how, rng)
    return tok, lp


def test_temperature_zero_is_greedy_with_the_plain_log_prob():
    tok, lp = _draws(Sampling(max_tokens=1, temperature=0.0), n=3)
    assert tok.tolist() == [1, 1, 1]
    torch.testing.assert_close(lp, torch.full((3,), math.log(0.5)))


def test_temperature_scales_logits_before_the_log_prob():
    tok, lp = _draws(Sampling(max_tokens=1, temperature=0.5))
    expected = torch.log_softmax(PROBS.log()[0] / 0.5, -1)
    torch.testing.assert_close(lp, expected[tok])
    assert set(tok.tolist()) == {0, 1, 2, 3}


def test_top_k_keeps_the_k_most_likely_and_renormalises():
    tok, lp = _draws(Sampling(max_tokens=1, temperature=1.0, top_k=2))
    assert set(tok.tolist()) == {1, 3}
    torch.testing.assert_close(lp[tok == 1], torch.full_like(lp[tok == 1], math.log(0.5 / 0.8)))
    assert abs((tok == 1).float().mean().item() - 0.5 / 0.8) < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 alone does not reach 0.7; 0.5 + 0.3 does: tokens 1 and 3.
    tok, lp = _draws(Sampling(max_tokens=1, temperature=1.0, top_p=0.7))
    assert set(tok.tolist()) == {1, 3}
    torch.testing.assert_close(lp[tok == 3], torch.full_like(lp[tok == 3], math.log(0.3 / 0.8)))
    # 0.5 reaches 0.5: the most likely token alone, whose log-prob is then 0.
    tok, lp = _draws(Sampling(max_tokens=1, temperature=1.0, top_p=0.5), n=50)
    assert tok.tolist() == [1] * 50 and lp.abs().max() == 0


def test_a_seeded_generator_draws_the_same_tokens():
    how = Sampling(max_tokens=1, temperature=1.0)
    assert torch.equal(_draws(how)[0], _draws(how)[0])
