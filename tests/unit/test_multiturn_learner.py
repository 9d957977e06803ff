"""The learner on multi-turn samples: observation tokens (loss mask 0 inside a response)
are never read by advantages, losses or metrics, and turn rewards land where they belong.

Masked positions hold junk (rewards 1e3, values 1e4, log-probs -50, versions 999, and
NaN/inf where the code claims a ``torch.where``): results at sampled positions must equal
those of the same batch with zeros there, and the pinned numbers.
"""

import zlib

import msgspec
import numpy as np
import pytest
import torch

from learners.advantages import (
    episode_returns,
    estimate,
    has_gaps,
    kl_controller,
    over_sampled_tokens,
)
from learners.batching import collate
from learners.distributed import DataParallel
from learners.evaluation import eval_row
from learners.step_metrics import episode_metrics, multiturn_metrics, step_row
from learners.update import StepStats, actor_loss
from verl_async import protocol as P
from verl_async.algos import (
    AGG_MODES,
    GlobalBatch,
    actor_inputs,
    reinforce_plus_plus_advantages,
    value_loss,
)
from verl_async.schema import AlgoConfig, KLConfig, RunConfig

# ----------------------------------------------------------------------------- collate


def _episode(**kw) -> P.EpisodeStats:
    base = dict(
        turns=2,
        tool_calls=1,
        tool_errors=0,
        tool_timeouts=0,
        env_seconds=0.5,
        observation_tokens=3,
        budget="",
        versions_spanned=1,
        template_mismatch=False,
        env_reward=0.25,
    )
    return P.EpisodeStats(**{**base, **kw})


TWO_TURNS = [1, 1, 0, 0, 0, 1, 1]


def _message(junk: bool = True, mask: bool = True, turn: bool = True, first=TWO_TURNS):
    """Sample 0: two turns (2 sampled tokens, 3 observation tokens, 2 sampled tokens: the
    loss mask ``first``); sample 1: single-turn, 2 tokens. ``junk``: the observation
    placeholders hold NaN, inf, 999 and 1e3 instead of the contract's 0.0, the previous
    version and 0."""
    frames = P.Frames()
    obs_behav = [np.nan, np.inf, -50.0] if junk else [0.0, 0.0, 0.0]
    obs_vers = [999, 999, 999] if junk else [3, 3, 3]
    obs_turn = [1e3, 1e3, 1e3] if junk else [0.0, 0.0, 0.0]
    fields = {}
    if mask:
        fields["loss_mask"] = frames.add(np.array([*first, 1, 1], np.uint8))
    if turn:
        turn_rewards = [0.0, 0.25, *obs_turn, 0.0, 0.5, 0.0, 0.0]
        fields["turn_rewards"] = frames.add(np.array(turn_rewards, np.float32))
    body = P.Batch(
        step=5,
        group_ids=[0, 1],
        sample_group=[0, 1],
        prompt_lengths=[3, 2],
        response_lengths=[7, 2],
        prompt_ids=frames.add(np.array([1, 5, 6, 1, 5], np.int32)),
        response_ids=frames.add(np.array([7, 8, 20, 21, 22, 9, 2, 7, 2], np.int32)),
        behav_logprobs=frames.add(
            np.array([-0.5, -0.6, *obs_behav, -0.7, -0.8, -0.9, -1.0], np.float32)
        ),
        token_versions=frames.add(np.array([3, 3, *obs_vers, 4, 4, 5, 5], np.int32)),
        scores=[[1.0], [0.0]],
        failed=[0],
        data_sources=["default", "default"],
        dropped_stale=0,
        buffer_size=0,
        episodes=[_episode(), None] if mask else [],
        **fields,
    )
    return body, [bytes(b) for b in frames.buffers]


def _collated(**kw):
    return collate(*_message(**kw), pad_id=0)


def test_collate_masks_observations_and_sanitises_their_placeholders():
    b = _collated()
    # Targets layout: sample 0's response starts at position p - 1 = 2, sample 1's at 1.
    assert b.input_ids.tolist() == [
        [1, 5, 6, 7, 8, 20, 21, 22, 9, 2],
        [1, 5, 7, 2, 0, 0, 0, 0, 0, 0],
    ]
    assert b.attention_mask.tolist() == [[1] * 10, [1] * 4 + [0] * 6]  # observations attend
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(
        b.behav_logprobs,
        torch.tensor([[0, 0, -0.5, -0.6, 0, 0, 0, -0.7, -0.8], [0, -0.9, -1.0, 0, 0, 0, 0, 0, 0]]),
    )
    assert b.token_versions.tolist() == [
        [-1, -1, 3, 3, -1, -1, -1, 4, 4],
        [-1, 5, 5, -1, -1, -1, -1, -1, -1],
    ]
    assert b.turn_rewards.tolist() == [[0, 0, 0, 0.25, 0, 0, 0, 0, 0.5], [0] * 9]
    assert b.episodes == [_episode(), None]
    # Junk or contract placeholders: the learner sees the same batch.
    clean = _collated(junk=False)
    for name in ("loss_mask", "behav_logprobs", "token_versions", "turn_rewards"):
        assert torch.equal(getattr(b, name), getattr(clean, name)), name


def test_a_single_turn_message_collates_as_before():
    b = _collated(mask=False, turn=False)
    assert b.turn_rewards is None and b.episodes == []
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert b.token_versions[0, 4].item() == 999  # nothing masked: taken as sent


def test_sample_digests_cover_the_loss_mask_and_turn_rewards():
    body, frames = _message(mask=False, turn=False)
    resp = np.array([7, 8, 20, 21, 22, 9, 2], np.int32)
    behav = P.tensor(body.behav_logprobs, frames)[:7]
    vers = P.tensor(body.token_versions, frames)[:7]
    digest = zlib.crc32(b"0.0")
    for part in (resp, behav, vers):
        digest = zlib.crc32(part.tobytes(), digest)
    plain = collate(body, frames, pad_id=0).sample_digests
    assert plain[0] == digest  # single-turn: the same digest as without the contract
    with_mask = _collated(turn=False).sample_digests
    with_both = _collated().sample_digests
    assert len({plain[0], with_mask[0], with_both[0]}) == 3
    # Another mask over the same tokens is another sample; sample 1 is unchanged.
    other = collate(*_message(first=[1, 1, 1, 0, 0, 1, 1]), pad_id=0).sample_digests
    assert other[0] != with_both[0] and other[1] == with_both[1]


def test_each_rank_gets_its_rows_of_the_turn_rewards():
    b = _collated()
    b.shard_sizes = [1, 1]
    second = DataParallel(rank=1, world=2).local(b)
    # Rank 1 holds sample 1 (4 tokens): [1, T-1] trimmed to width 3.
    assert second.turn_rewards.shape == second.loss_mask.shape == (1, 3)
    assert second.turn_rewards.tolist() == [[0, 0, 0]]
    first = DataParallel(rank=0, world=2).local(b)
    assert torch.equal(first.turn_rewards, b.turn_rewards[:1])
    none = _collated(mask=False, turn=False)
    none.shard_sizes = [1, 1]
    assert DataParallel(rank=1, world=2).local(none).turn_rewards is None


# ----------------------------------------------------------------------------- advantages

# Four two-turn samples in two groups, targets layout [4, 8]: prompt, turn 1, observation
# tokens (0 inside the response), turn 2, padding.
SAMPLED = [[1, 2, 5, 6], [1, 4, 5, 6], [2, 3, 5], [1, 2, 3, 6, 7]]
MASK = torch.zeros(4, 8)
for _i, _cols in enumerate(SAMPLED):
    MASK[_i, _cols] = 1
OUTCOME = torch.tensor([1.0, 0.0, 0.5, -0.5])
GROUPS = torch.tensor([0, 0, 1, 1])
TURN = torch.zeros(4, 8)  # each turn's reward at its last sampled token
TURN[0, 2], TURN[1, 1], TURN[2, 3], TURN[3, 3] = 0.2, -0.1, 0.3, 0.1  # turn 1
TURN[0, 6] = 0.4  # turn 2 of sample 0
VALUES = 0.1 * torch.arange(8.0) + 0.05 * torch.arange(4.0)[:, None]
LOGP_OLD = torch.full((4, 8), -1.0)
LOGP_REF = torch.full((4, 8), -1.25)  # k1 = 0.25 per sampled token; coef 0.2 -> -0.05


def _junk(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(MASK > 0, x, torch.full_like(x, value))


def _zeroed(x: torch.Tensor) -> torch.Tensor:
    return _junk(x, 0.0)


def _estimate(estimator: str, kl: bool, junk: bool, normalize: bool = False):
    cfg = msgspec.structs.replace(
        AlgoConfig(),
        adv_estimator=estimator,
        gamma=0.9,
        lam=0.8,
        normalize_adv_std=normalize,
        kl=KLConfig(in_reward=kl, penalty="kl", coef=0.2),
    )
    put = (lambda x, v: _junk(x, v)) if junk else (lambda x, v: _zeroed(x))
    return estimate(
        cfg, OUTCOME, GROUPS, MASK,
        put(VALUES, 1e4), put(LOGP_OLD, -50.0), put(LOGP_REF, -50.0),
        kl_controller(cfg.kl), put(TURN, 1e3),
    )  # fmt: skip


def _at_sampled(rows) -> torch.Tensor:
    out = torch.zeros(4, 8)
    for i, values in enumerate(rows):
        out[i, SAMPLED[i]] = torch.tensor(values)
    return out


# Computed by hand-written loops over each row's sampled tokens only (the compacted
# sequence; gamma 0.9, lam 0.8, values 0.1 t + 0.05 i at position t of row i), outside
# verl_async: token rewards -> returns -> advantages centred over the batch's sampled
# tokens (normalize_adv_std false). grpo is then Dr. GRPO: total - group mean.
PINNED = {
    ("grpo", False): ([0.85, -0.85, 0.6, -0.6], None),
    ("grpo", True): ([0.85, -0.85, 0.65, -0.65], None),
    ("rloo", False): ([1.7, -1.7, 1.2, -1.2], None),
    ("rloo", True): ([1.7, -1.7, 1.3, -1.3], None),
    ("reinforce_plus_plus", False): (
        [[0.872909, 1.006309, 0.932309, 1.072309], [-0.427691, -0.327691, -0.327691, -0.327691],
         [0.347309, 0.422309, 0.172309], [-0.574741, -0.602191, -0.632691, -0.777691, -0.827691]],
        [[1.2006, 1.334, 1.26, 1.4], [-0.1, 0.0, 0.0, 0.0], [0.675, 0.75, 0.5],
         [-0.24705, -0.2745, -0.305, -0.45, -0.5]],
    ),
    ("reinforce_plus_plus", True): (
        [[0.816122, 0.985972, 0.952472, 1.137472], [-0.484478, -0.348028, -0.307528, -0.262528],
         [0.326972, 0.442472, 0.237472], [-0.664333, -0.658978, -0.653028, -0.757528, -0.762528]],
        [[1.02865, 1.1985, 1.165, 1.35], [-0.27195, -0.1355, -0.095, -0.05],
         [0.5395, 0.655, 0.45], [-0.451805, -0.44645, -0.4405, -0.545, -0.55]],
    ),
    ("gae", False): (
        [[0.768539, 0.938725, 0.661205, 0.845205], [0.008138, -0.221555, -0.387795, -0.604795],
         [0.370165, 0.413205, -0.054795], [-0.038913, -0.161904, -0.318835, -0.911795, -1.304795]],
        [[0.823334, 1.09352, 1.116, 1.4], [0.112933, 0.18324, 0.117, 0.0],
         [0.62496, 0.768, 0.5], [0.165882, 0.142891, 0.08596, -0.207, -0.5]],
    ),
    ("gae", True): (
        [[0.733422, 0.92227, 0.67067, 0.89067], [-0.026979, -0.23801, -0.37833, -0.55933],
         [0.35371, 0.42267, -0.00933], [-0.087467, -0.197021, -0.33529, -0.90233, -1.25933]],
        [[0.692752, 0.9816, 1.03, 1.35], [-0.01765, 0.07132, 0.031, -0.05],
         [0.51304, 0.682, 0.45], [0.021862, 0.012309, -0.02596, -0.293, -0.55]],
    ),
}  # fmt: skip


@pytest.mark.parametrize(("estimator", "kl"), list(PINNED))
def test_estimators_read_sampled_tokens_only_and_match_pinned_values(estimator, kl):
    clean = _estimate(estimator, kl, junk=False)
    junk = _estimate(estimator, kl, junk=True)
    assert torch.equal(junk.advantages, clean.advantages)
    assert (junk.returns is None) == (clean.returns is None)
    if clean.returns is not None:
        assert torch.equal(junk.returns, clean.returns)
    assert junk.kl_in_reward == clean.kl_in_reward
    advantages, returns = PINNED[(estimator, kl)]
    if returns is None:  # one advantage per sample, on each of its sampled tokens
        expected = torch.tensor(advantages)[:, None] * MASK
    else:
        expected = _at_sampled(advantages)
        torch.testing.assert_close(clean.returns, _at_sampled(returns), atol=2e-6, rtol=0)
    torch.testing.assert_close(clean.advantages, expected, atol=2e-6, rtol=0)
    if kl:
        assert clean.kl_in_reward == pytest.approx(0.25)  # over sampled tokens only
    # Whitened (the default) is the centred advantage over the sampled tokens' std.
    whitened = _estimate(estimator, kl, junk=True, normalize=True).advantages
    assert torch.equal(whitened, _estimate(estimator, kl, junk=False, normalize=True).advantages)
    if returns is not None:
        std = float(expected[MASK > 0].std())
        torch.testing.assert_close(whitened, expected / std, atol=1e-5, rtol=1e-5)


def test_turn_rewards_land_on_each_turns_last_sampled_token_and_gae_sees_them():
    out = _estimate("gae", kl=False, junk=True)
    expected = TURN.clone()
    for i, cols in enumerate(SAMPLED):
        expected[i, cols[-1]] += OUTCOME[i]  # the outcome on the last sampled token
    assert torch.equal(out.token_rewards, expected)
    # gamma = lambda = 1 and zero values: each sampled token's return is the sum of the
    # rewards from it on; an observation in between adds nothing and is not discounted.
    cfg = msgspec.structs.replace(AlgoConfig(), adv_estimator="gae", gamma=1.0, lam=1.0)
    flat = estimate(cfg, OUTCOME, GROUPS, MASK, _junk(torch.zeros(4, 8), 1e4), turn_rewards=TURN)
    pinned = [[1.6, 1.6, 1.4, 1.4], [-0.1, 0.0, 0.0, 0.0], [0.8, 0.8, 0.5], [-0.4] * 3 + [-0.5] * 2]
    torch.testing.assert_close(flat.returns, _at_sampled(pinned))


def test_compaction_is_skipped_without_gaps_and_restores_positions_with_them():
    single = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    assert not has_gaps(single) and has_gaps(MASK)
    rewards = torch.arange(15.0).reshape(3, 5)

    def rfpp(m, r):
        return reinforce_plus_plus_advantages(r, m, 0.5)

    alone = reinforce_plus_plus_advantages(rewards, single, 0.5)
    for got, want in zip(over_sampled_tokens(rfpp, single, rewards), alone, strict=True):
        assert torch.equal(got, want)  # bit for bit: the single-turn path is untouched
    # With a gap, verl's REINFORCE++ would restart at the observation; here it does not.
    gap = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.float32)
    _, returns = over_sampled_tokens(rfpp, gap, torch.tensor([[1.0, 2.0, 99.0, 99.0, 4.0]]))
    assert returns.tolist() == [[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 0, 0, 4]]


def test_episode_return_is_the_outcome_plus_the_turn_rewards():
    returns = episode_returns(OUTCOME, TURN)
    torch.testing.assert_close(returns, torch.tensor([1.6, -0.1, 0.8, -0.4]))
    assert episode_returns(OUTCOME, None) is OUTCOME


# ----------------------------------------------------------------------------- losses

# Two rows with gaps: row 0 keeps 3 tokens, row 1 keeps 2; per-token advantages there.
LOSS_MASK = torch.tensor([[0, 1, 1, 0, 0, 1], [1, 0, 0, 1, 0, 0]], dtype=torch.float32)
LOSS_ADV = torch.tensor([[0, 1.0, 2.0, 0, 0, 3.0], [-1.0, 0, 0, 4.0, 0, 0]])
LOGP = torch.tensor([[-1.0, -1.1, -1.2, -1.3, -1.4, -1.5], [-0.9, -0.8, -0.7, -0.6, -0.5, -0.4]])


def _loss_inputs(fill: float | None):
    """(logp, logp_prox, behav, adv, entropy, logp_ref); ``fill`` replaces the masked
    entries of every input but logp (None: leave the clean values)."""
    put = (lambda x: x) if fill is None else (lambda x: torch.where(LOSS_MASK > 0, x, fill))
    logp = LOGP.clone().requires_grad_(True)
    return (
        logp,
        put(LOGP.clone()),
        put(LOGP.clone()),
        put(LOSS_ADV),
        put(torch.full_like(LOGP, 0.7)),
        put(LOGP - 0.3),
    )


def _actor(mode: str, fill: float | None):
    algo = msgspec.structs.replace(
        AlgoConfig(), correction="none", loss_agg_mode=mode, loss_scale_factor=4.0,
        entropy_coeff=0.1, kl=KLConfig(loss_coef=0.5, loss_type="low_var_kl"),
    )  # fmt: skip
    logp, prox, behav, adv, entropy, ref = _loss_inputs(fill)
    inputs, _ = actor_inputs(logp, prox, behav, adv, LOSS_MASK, algo)
    out = actor_loss(inputs, algo, entropy, ref)
    out.total.backward()
    return out, out.pg.loss, out.kl_loss, logp.grad


# Ratio 1 everywhere (logp = prox = behav), so the per-token policy loss is -A:
# token-mean -(1+2+3-1+4)/5; seq-mean-token-sum mean(-6, -3); seq-mean-token-mean
# mean(-6/3, -3/2): each row over its own sampled tokens; token-sum -9;
# seq-mean-token-sum-norm mean(-6, -3) / 4, the configured constant, whatever the rows'
# lengths (verl 1dda039).
PG_LOSS = {
    "token-mean": -1.8,
    "seq-mean-token-sum": -4.5,
    "seq-mean-token-mean": -1.75,
    "seq-mean-token-sum-norm": -1.125,
    "token-sum": -9.0,
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_actor_loss_terms_ignore_masked_positions(mode):
    out, pg_loss, kl_loss, grad = _actor(mode, None)
    assert float(pg_loss.detach()) == pytest.approx(PG_LOSS[mode], abs=1e-6)
    for fill in (1e3, -50.0):  # finite junk: same losses, same gradients
        j_out, j_pg, j_kl, j_grad = _actor(mode, fill)
        assert torch.equal(j_out.total, out.total) and torch.equal(j_pg, pg_loss), fill
        assert torch.equal(j_kl, kl_loss), fill
        assert torch.equal(j_grad, grad), fill
        assert torch.all(j_grad[LOSS_MASK == 0] == 0)
        assert torch.equal(j_out.pg.pg_clipfrac, out.pg.pg_clipfrac)
        assert torch.equal(j_out.pg.ppo_kl, out.pg.ppo_kl)
    for fill in (float("nan"), float("inf")):  # agg_loss's torch.where keeps the values
        j_out, j_pg, j_kl, _ = _actor(mode, fill)
        assert torch.equal(j_out.total, out.total) and torch.equal(j_kl, kl_loss), fill


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_ignores_masked_positions(mode):
    def run(fill):
        put = (lambda x: x) if fill is None else (lambda x: torch.where(LOSS_MASK > 0, x, fill))
        values = (0.1 * LOGP).clone().requires_grad_(True)
        old, returns = put(0.1 * LOGP + 0.6), put(LOSS_ADV)
        batch = GlobalBatch(loss_scale_factor=4.0)
        loss, clipfrac = value_loss(values, old, returns, LOSS_MASK, 0.5, mode, batch)
        loss.backward()
        return loss, clipfrac, values.grad

    loss, clipfrac, grad = run(None)
    for fill in (1e4, -1e4):
        j_loss, j_clip, j_grad = run(fill)
        assert torch.equal(j_loss, loss) and torch.equal(j_clip, clipfrac), fill
        assert torch.equal(j_grad, grad), fill
    for fill in (float("nan"), float("inf")):
        assert torch.equal(run(fill)[0], loss), fill


# ----------------------------------------------------------------------------- metrics


def _stats() -> StepStats:
    return StepStats(
        loss=0.0, pg_loss=0.0, kl=0.0, entropy=0.0, clip_fraction=0.0, clip_fraction_lower=0.0,
        ppo_kl=0.0, is_weight_mean=1.0, is_weight_max=1.0, is_clipped_fraction=0.0,
        grad_norm=0.0,
    )  # fmt: skip


def test_staleness_reads_the_versions_of_sampled_tokens_only():
    b = _collated()
    b.rewards = torch.zeros(2)
    b.token_versions[0, 4:7] = 999  # whatever an observation (or padding) carries
    b.token_versions[1, 5] = 999
    row = step_row(6, 6, 2, b, _stats(), 0.0, 0.0, 0.0)
    # Sample 0: versions 3 and 4 (staleness 3, in flight); sample 1: version 5 only.
    assert (row["staleness_max"], row["staleness_mean"]) == (3, 2.0)
    assert row["inflight_update_samples"] == 1
    assert row["response_tokens"] == 6  # sampled tokens; the 3 observation tokens are not


def test_episode_metrics_pinned():
    episodes = [
        _episode(),
        _episode(turns=4, tool_calls=3, tool_errors=2, tool_timeouts=1, env_seconds=2.5,
                 observation_tokens=40, budget="turns", versions_spanned=3,
                 tool_parse_errors=2),
        _episode(turns=3, tool_calls=2, env_seconds=1.0, observation_tokens=17,
                 budget="episode_tokens", versions_spanned=0, template_mismatch=True),
    ]  # fmt: skip
    row = episode_metrics(episodes, [10, 20, 36])
    assert row == {
        "multiturn/turns_mean": 3.0,
        "multiturn/turns_max": 4,
        "multiturn/tool_calls": 2.0,
        "multiturn/tool_errors": 2,
        "multiturn/tool_timeouts": 1,
        "multiturn/tool_parse_errors": 2,
        "multiturn/prefix_breaks": 0,
        "multiturn/env_seconds": pytest.approx(4.0 / 3),
        "multiturn/observation_tokens": 20.0,
        "multiturn/sampled_tokens": 22.0,
        "multiturn/budget_hits": 2,
        "multiturn/budget_hits/turns": 1,
        "multiturn/budget_hits/turn_tokens": 0,
        "multiturn/budget_hits/episode_tokens": 1,
        "multiturn/budget_hits/episode_timeout": 0,
        "multiturn/versions_spanned_mean": pytest.approx(4.0 / 3),
        "multiturn/versions_spanned_max": 3,
        "multiturn/template_mismatch": 1,
    }


def test_step_metrics_of_multi_turn_samples_only():
    row = multiturn_metrics(_collated())
    # Sample 0 alone is an episode: 4 sampled tokens, turn rewards 0.25 + 0.5.
    assert row["multiturn/env_reward"] == pytest.approx(0.75)
    assert row["multiturn/sampled_tokens"] == 4.0
    assert row["multiturn/observation_tokens"] == 3.0
    assert multiturn_metrics(_collated(mask=False, turn=False)) == {}


def test_eval_row_reports_environment_reward_and_turns_when_present():
    def result(i, **kw):
        return P.EvalResult(
            group_id=i, data_source="default", scores=[[1.0, 0.0]], failed=[0],
            response_lengths=[3, 5], versions=[0, 0], example="", **kw,
        )  # fmt: skip

    report = P.EvalReport(
        round=0, step=0, version=0, seconds=1.0,
        results=[result(0, env_rewards=[0.5, 1.0], turns=[2, 3]), result(1)],
    )  # fmt: skip
    row = eval_row(report, RunConfig())
    assert row["eval/env_reward"] == 0.75 and row["eval/turns_mean"] == 2.5
    assert row["eval/reward_mean"] == 0.5  # the outcome scores, as for single-turn rounds
    plain = eval_row(msgspec.structs.replace(report, results=[result(1)]), RunConfig())
    assert "eval/env_reward" not in plain and "eval/turns_mean" not in plain


def test_the_learner_trains_on_the_outcome_plus_turn_rewards_and_reports_the_return():
    from types import SimpleNamespace

    from learners.trainer import Learner

    cfg = RunConfig()
    algo = msgspec.structs.replace(cfg.algo, adv_estimator="rloo")
    learner = SimpleNamespace(
        cfg=cfg, running={}, algo=algo, reference=None, critic=None, dp=DataParallel(),
        acc=SimpleNamespace(device=torch.device("cpu")), kl_ctrl=kl_controller(algo.kl),
    )  # fmt: skip
    b = _collated()
    adv = Learner.compute_advantages(learner, b, b)
    # Scores 1 and 0; sample 0's turn rewards 0.25 + 0.5. Groups of one: rloo keeps the
    # return, on the sampled tokens only.
    torch.testing.assert_close(b.rewards, torch.tensor([1.75, 0.0]))
    torch.testing.assert_close(adv.advantages, torch.tensor([1.75, 0.0])[:, None] * b.loss_mask)
