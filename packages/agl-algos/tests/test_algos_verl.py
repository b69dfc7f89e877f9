"""Equivalence with verl and registration into its policy-loss registry (skipped without verl)."""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_testing.requirements import TOKEN_SUM_REASON, import_optional, skip_unless

import_optional("verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

import agl_algos.verl as agl_verl  # noqa: E402
from agl_algos import (  # noqa: E402
    MissingFieldError,
    RemaxNotSupportedError,
    RolloutConsistencyError,
    compute_policy_loss_cispo_per_rollout_mean,
    compute_policy_loss_geo_mean_per_rollout,
    compute_policy_loss_gspo_per_rollout,
    compute_policy_loss_per_rollout_mean,
    compute_rollout_level_advantage,
    normalize_advantages_by_rollout,
    rollout_index_context,
)
from agl_algos.verl import _compat  # noqa: E402

pytestmark = pytest.mark.verl


def actor_config(**overrides: object) -> FSDPActorConfig:
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **overrides)  # type: ignore[arg-type]


def test_registry_lookup_returns_our_losses() -> None:
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is compute_policy_loss_per_rollout_mean
    assert (
        core_algos.get_policy_loss_fn("cispo_per_rollout_mean") is compute_policy_loss_cispo_per_rollout_mean
    )
    assert core_algos.get_policy_loss_fn("gspo_per_rollout") is compute_policy_loss_gspo_per_rollout
    assert core_algos.get_policy_loss_fn("geo_mean_per_rollout") is compute_policy_loss_geo_mean_per_rollout


def test_registration_is_idempotent_across_reimport_and_worker_hook() -> None:
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    importlib.reload(agl_verl)
    agl_verl.register_in_worker()
    agl_verl.register()
    assert before == core_algos.POLICY_LOSS_REGISTRY
    assert agl_verl.WORKER_SETUP_HOOK == "agl_algos.verl.register_in_worker"


def test_a_foreign_loss_under_our_name_is_replaced() -> None:
    core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"] = core_algos.get_policy_loss_fn("vanilla")
    agl_verl.register()
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is compute_policy_loss_per_rollout_mean


@st.composite
def multi_row_rollouts(
    draw: st.DrawFn, rewards: st.SearchStrategy[float]
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """(N, 4) rewards on the last token and masks, with 1-3 rows per rollout in shuffled row order."""
    rows: list[tuple[str, str, float]] = []
    for r in range(draw(st.integers(1, 12))):
        uid, reward = draw(st.sampled_from(["p", "q", "r"])), draw(rewards)
        rows += [(f"r{r}", uid, reward)] * draw(st.integers(1, 3))
    rows = [rows[i] for i in draw(st.permutations(range(len(rows))))]
    mask = torch.tensor([draw(st.lists(st.integers(0, 1), min_size=4, max_size=4)) for _ in rows])
    token_rewards = torch.zeros(len(rows), 4)
    token_rewards[:, -1] = torch.tensor([reward for _, _, reward in rows])
    return token_rewards, mask, [r[0] for r in rows], [r[1] for r in rows]


def verl_grpo_broadcast(
    rewards: torch.Tensor, mask: torch.Tensor, rollout_ids: list[str], uids: list[str], norm: bool
) -> torch.Tensor:
    """verl's GRPO over each rollout's first row, its scalar copied onto every row of the rollout."""
    first = {rid: row for row, rid in reversed(list(enumerate(rollout_ids)))}
    reps = sorted(first.values())
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        rewards[reps],
        torch.ones(len(reps), rewards.shape[1]),
        np.array([uids[r] for r in reps], dtype=object),
        norm_adv_by_std_in_grpo=norm,
    )
    scalar = {rollout_ids[r]: float(theirs[k, 0]) for k, r in enumerate(reps)}
    return torch.tensor([[scalar[rid]] for rid in rollout_ids]) * mask


@settings(max_examples=40, deadline=None)
@given(multi_row_rollouts(st.floats(-4, 4, width=32)), st.booleans())
def test_grpo_equals_verl_in_float64_on_the_representatives(
    batch: tuple[torch.Tensor, torch.Tensor, list[str], list[str]], norm: bool
) -> None:
    # Our group statistics are float64; verl's follow the reward dtype, so fed float64 rewards verl
    # runs the same arithmetic and the two agree on any rewards, equal-reward groups included.
    rewards, mask, rollout_ids, uids = batch
    ours = compute_rollout_level_advantage(rewards, mask, rollout_ids, uids, norm_adv_by_std_in_grpo=norm)
    theirs = verl_grpo_broadcast(rewards.double(), mask, rollout_ids, uids, norm).float()
    torch.testing.assert_close(ours.advantages, theirs, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(multi_row_rollouts(st.sampled_from([0.0, 1.0, 0.5, 0.25, -1.0, 3.0])), st.booleans())
def test_grpo_equals_verl_in_float32_on_rewards_float32_averages_exactly(
    batch: tuple[torch.Tensor, torch.Tensor, list[str], list[str]], norm: bool
) -> None:
    # Binary and other dyadic rewards: a group of equal ones has an exact float32 mean, so verl's
    # float32 pipeline, as the trainer runs it, leaves no residue.
    rewards, mask, rollout_ids, uids = batch
    ours = compute_rollout_level_advantage(rewards, mask, rollout_ids, uids, norm_adv_by_std_in_grpo=norm)
    theirs = verl_grpo_broadcast(rewards, mask, rollout_ids, uids, norm)
    torch.testing.assert_close(ours.advantages, theirs, rtol=1e-6, atol=1e-6)


def test_seven_rewards_of_0_7_get_0_in_ours_and_0_056_in_verls_float32() -> None:
    rewards = torch.zeros(7, 2)
    rewards[:, -1] = 0.7
    mask, ids = torch.ones(7, 2), [f"r{i}" for i in range(7)]
    ours = compute_rollout_level_advantage(rewards, mask, ids, ["g"] * 7).advantages
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, np.array(["g"] * 7, dtype=object))
    assert ours.flatten().tolist() == [0.0] * 14
    # GRPO's (score - mean) / (std + eps) in float32, as verl computes it: float32 rounding makes
    # the mean miss 0.7 and the (unbiased) std come out about 6.4e-8 rather than 0.
    scores = torch.full((7,), 0.7)
    mean, std = scores.mean(), scores.std()
    assert 0.0 < std.item() < 1e-7
    expected = ((scores - mean) / (std + 1e-6)).tolist()
    assert expected[0] > 0.05  # far from the 0 exact arithmetic gives, as ours does
    assert theirs[:, 0].tolist() == expected
    assert theirs[:, 1].tolist() == expected


def loss_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """old and new log-probs, advantages, a 75% mask and importance weights, all (6, 10)."""
    gen = torch.Generator().manual_seed(seed)
    old, new = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)
    advantages = torch.randn(6, 10, generator=gen)
    mask = torch.rand(6, 10, generator=gen) > 0.25
    return old, new, advantages, mask, torch.rand(6, 10, generator=gen)


def assert_loss_equals_vanilla(inputs: tuple[torch.Tensor, ...], config: Any, *, their_mode: str) -> None:
    """Our loss (its own masked-sum aggregation) equals verl's vanilla loss in ``their_mode``."""
    old, new, advantages, mask, weights = inputs
    ours, our_metrics = compute_policy_loss_per_rollout_mean(
        old, new, advantages, mask, config=config, rollout_is_weights=weights
    )
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    theirs, their_metrics = vanilla(old, new, advantages, mask, their_mode, config, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert our_metrics == pytest.approx(their_metrics, abs=1e-6)


def verl_has_token_sum() -> bool:
    try:
        core_algos.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")
    except ValueError:
        return False
    return True


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_loss_equals_verl_vanilla_token_mean_over_one_global_token_scaled_by_dp(
    seed: int, dp_size: int, low: float, high: float
) -> None:
    # token-mean divides the masked sum by the global token count; with a count of 1 it is the
    # masked sum x dp, our aggregation, in every supported release.
    config = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    config.global_batch_info.update({"dp_size": dp_size, "batch_num_tokens": 1})
    assert_loss_equals_vanilla(loss_inputs(seed), config, their_mode="token-mean")


def assert_loss_equals_verls(
    ours_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]],
    their_mode: str,
    inputs: tuple[torch.Tensor, ...],
    config: Any,
) -> None:
    """``ours_fn`` equals verl's ``their_mode`` loss aggregated by token-sum: value, gradient, metrics."""
    old, new, advantages, mask, weights = inputs
    ours_lp, theirs_lp = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    ours, our_metrics = ours_fn(old, ours_lp, advantages, mask, "token-mean", config, weights)
    theirs, their_metrics = core_algos.get_policy_loss_fn(their_mode)(
        old, theirs_lp, advantages, mask, "token-sum", config, weights
    )
    (ours + theirs).backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-6)
    assert our_metrics == pytest.approx(their_metrics, abs=1e-6)


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_cispo_per_rollout_mean_equals_verl_cispo_token_sum(
    seed: int, dp_size: int, low: float, high: float
) -> None:
    # Agent Lightning 1.0.2's cispo_per_rollout_mean is verl's CISPO token loss, masked sum x dp_size
    config = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    config.global_batch_info.update({"dp_size": dp_size})
    assert_loss_equals_verls(compute_policy_loss_cispo_per_rollout_mean, "cispo", loss_inputs(seed), config)


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_gspo_per_rollout_with_one_row_per_rollout_equals_verl_gspo_token_sum(
    seed: int, dp_size: int, low: float, high: float
) -> None:
    config = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    config.global_batch_info.update({"dp_size": dp_size})
    old, new, advantages, mask, weights = loss_inputs(seed)
    inputs = (old, old + (new - old) * 0.1, advantages, mask, weights)  # ratios near 1: some clipped, not all
    with rollout_index_context(torch.arange(6)):
        assert_loss_equals_verls(compute_policy_loss_gspo_per_rollout, "gspo", inputs, config)


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_loss_equals_verl_vanilla_token_sum_scaled_by_dp(
    seed: int, dp_size: int, low: float, high: float
) -> None:
    config = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    config.global_batch_info.update({"dp_size": dp_size})
    assert_loss_equals_vanilla(loss_inputs(seed), config, their_mode="token-sum")


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "dppo_tv"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), dp_size=st.integers(1, 4))
def test_a_verl_token_level_loss_is_registered_summed_over_tokens(
    loss_mode: str, seed: int, dp_size: int
) -> None:
    config = actor_config()
    config.global_batch_info.update({"dp_size": dp_size, "batch_num_tokens": 7})
    old, new, advantages, mask, weights = loss_inputs(seed)
    summed = core_algos.get_policy_loss_fn(f"rollout_summed:{loss_mode}")
    # the actor's own loss_agg_mode (token-mean here) is overridden for the policy term only
    ours, our_metrics = summed(
        old_log_prob=old,
        log_prob=new,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=weights,
    )
    theirs, their_metrics = core_algos.get_policy_loss_fn(loss_mode)(
        old, new, advantages, mask, "token-sum", config, weights
    )
    mean, _ = core_algos.get_policy_loss_fn(loss_mode)(
        old, new, advantages, mask, "token-mean", config, weights
    )
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours, mean * 7)  # token-mean divides the same masked sum by 7 tokens
    assert our_metrics == pytest.approx(their_metrics)


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
def test_sequence_level_verl_losses_are_not_registered_summed() -> None:
    summed = {name for name in core_algos.POLICY_LOSS_REGISTRY if name.startswith("rollout_summed:")}
    assert summed == {f"rollout_summed:{name}" for name in agl_verl.VERL_TOKEN_LEVEL_LOSSES}
    assert not summed & {"rollout_summed:gspo", "rollout_summed:geo_mean", "rollout_summed:sapo"}


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)
@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cut=st.integers(1, 5))
def test_a_rollout_split_into_two_rows_gives_the_same_summed_verl_loss_and_gradient(
    loss_mode: str, seed: int, cut: int
) -> None:
    # rollout a: 6 tokens, one row or cut into two rows at `cut`; rollout b: 3 tokens, one row
    gen = torch.Generator().manual_seed(seed)
    old, new = torch.randn(9, generator=gen), torch.randn(9, generator=gen) * 0.3
    new = old + new
    token_adv = torch.tensor([1.5] * 6 + [-0.5] * 3)
    summed = core_algos.get_policy_loss_fn(f"rollout_summed:{loss_mode}")

    def loss_and_grad(
        row_tokens: list[list[int]], rollout_ids: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(row_tokens), 6)
        o, n, a, m = (
            torch.zeros(shape),
            torch.zeros(shape),
            torch.zeros(shape),
            torch.zeros(shape, dtype=torch.bool),
        )
        for row, tokens in enumerate(row_tokens):
            cols = torch.arange(len(tokens))
            o[row, cols], n[row, cols] = old[tokens], new[tokens]
            a[row, cols], m[row, cols] = token_adv[tokens], True
        log_prob = n.clone().requires_grad_(True)
        normalized = normalize_advantages_by_rollout(a, m.long(), rollout_ids)
        loss, _ = summed(
            old_log_prob=o,
            log_prob=log_prob,
            advantages=normalized,
            response_mask=m,
            loss_agg_mode="token-mean",
            config=actor_config(),
            rollout_is_weights=None,
        )
        loss.backward()
        assert log_prob.grad is not None
        return loss.detach(), log_prob.grad[m]

    whole = loss_and_grad([list(range(6)), [6, 7, 8]], ["a", "b"])
    split = loss_and_grad([list(range(cut)), list(range(cut, 6)), [6, 7, 8]], ["a", "a", "b"])
    torch.testing.assert_close(split[0], whole[0])
    torch.testing.assert_close(split[1], whole[1])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_geo_mean_per_rollout_with_one_row_per_rollout_equals_verl_geo_mean(
    seed: int, low: float, high: float
) -> None:
    # verl averages -A_row * ratio_row over the rows; ours sums rollouts, so with one row per rollout
    # and the advantages divided by (tokens x rollouts) the two agree: value, gradient, metrics.
    config = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    old, new, _, mask, weights = loss_inputs(seed)
    mask[:, 0] = True  # every row trains a token
    new = old + (new - old) * 0.3
    advantages = torch.randn(6, 1, generator=torch.Generator().manual_seed(seed)).expand(6, 10) * mask
    normalized = normalize_advantages_by_rollout(advantages, mask.long(), list(range(6)))
    ours_lp, theirs_lp = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    ours, our_metrics = compute_policy_loss_geo_mean_per_rollout(
        old,
        ours_lp,
        normalized,
        mask,
        config=config,
        rollout_is_weights=weights,
        rollout_index=torch.arange(6),
    )
    theirs, their_metrics = core_algos.get_policy_loss_fn("geo_mean")(
        old, theirs_lp, advantages, mask, "token-mean", config, weights
    )
    (ours + theirs).backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours_lp.grad is not None and theirs_lp.grad is not None
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-4, atol=1e-6)
    assert our_metrics == pytest.approx(their_metrics, abs=1e-6)


def data_proto(
    row_rewards: list[float],
    mask: torch.Tensor,
    rollout_ids: list[str],
    uids: list[str],
    *,
    uid_key: str = "uid",
) -> DataProto:
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.tensor(row_rewards)
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={
            "rollout_id_list": np.array(rollout_ids, dtype=object),
            uid_key: np.array(uids, dtype=object),
        },
    )


def test_data_proto_wrapper_writes_grpo_advantages_and_returns() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 1], [1, 1, 1]])
    batch = data_proto([1, 1, 0, 0], mask, ["a", "a", "b", "c"], ["g"] * 4, uid_key="data_id_list")
    out, metrics = agl_verl.compute_rollout_level_advantage_data_proto(
        batch, adv_estimator="grpo", num_repeat=3
    )
    # group {1, 0, 0}: mean 1/3, std sqrt(1/3); (2/3) / (0.57735027 + 1e-6), (-1/3) / (0.57735027 + 1e-6)
    a, other = 1.1546985, -0.5773493
    expected = torch.tensor([[a, a, a], [a, 0, a], [other] * 3, [other] * 3])
    assert out is batch and "uid" not in batch.non_tensor_batch
    torch.testing.assert_close(batch.batch["advantages"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.batch["returns"], expected, rtol=0, atol=1e-6)
    assert metrics["training/rollout_level_advantage/n_multi_row_rollouts"] == 1


def test_data_proto_wrapper_accepts_verl_enum_and_delegates_rloo() -> None:
    mask = torch.ones(4, 2)
    batch = data_proto([1, 1, 0, 1], mask, ["a", "a", "b", "c"], ["g"] * 4)
    agl_verl.compute_rollout_level_advantage_data_proto(
        batch, adv_estimator=core_algos.AdvantageEstimator.RLOO
    )
    # RLOO over a=1, b=0, c=1: each minus the mean of the others -> 0.5, -1, 0.5
    assert batch.batch["advantages"][:, 0].tolist() == pytest.approx([0.5, 0.5, -1.0, 0.5])


def test_data_proto_wrapper_refuses_remax() -> None:
    batch = data_proto([1.0], torch.ones(1, 2), ["a"], ["g"])
    with pytest.raises(RemaxNotSupportedError, match="remax"):
        agl_verl.compute_rollout_level_advantage_data_proto(
            batch, adv_estimator=core_algos.AdvantageEstimator.REMAX
        )


def test_data_proto_wrapper_rejects_gae_as_token_varying() -> None:
    batch = data_proto([1.0, 0.0], torch.ones(2, 3), ["a", "b"], ["g", "g"])
    batch.batch["values"] = torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.0, 0.9]])
    with pytest.raises(RolloutConsistencyError, match="outcome estimator"):
        agl_verl.compute_rollout_level_advantage_data_proto(
            batch, adv_estimator="gae", gamma=1.0, lam=0.9, config={"use_pf_ppo": False}
        )


def test_data_proto_wrapper_names_a_missing_field() -> None:
    batch = data_proto([1.0], torch.ones(1, 2), ["a"], ["g"])
    batch.non_tensor_batch.pop("rollout_id_list")
    with pytest.raises(MissingFieldError, match="rollout_id_list"):
        agl_verl.compute_rollout_level_advantage_data_proto(batch, adv_estimator="grpo")


def test_normalized_advantages_through_verl_registry_weigh_rollouts_equally() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    advantages = normalize_advantages_by_rollout(
        torch.ones(3, 4) * mask, mask, ["long", "short", "short"], divisor="rollouts"
    )
    log_prob = torch.zeros(3, 4, requires_grad=True)
    loss_fn = core_algos.get_policy_loss_fn("per_rollout_mean")
    loss, _ = loss_fn(torch.zeros(3, 4), log_prob, advantages, mask, "token-mean", actor_config(), None)
    loss.backward()
    assert log_prob.grad is not None
    grad = log_prob.grad.sum(-1)
    # two rollouts, one vote each: -1/2 on the 4-token rollout, -1/2 on the one split into two rows
    assert [grad[0].item(), (grad[1] + grad[2]).item()] == pytest.approx([-1 / 2, -1 / 2])


@pytest.mark.parametrize(
    ("installed", "warns"), [("0.6.0", True), ("0.7.1", False), ("0.9.1", False), ("0.10.0", True)]
)
def test_a_verl_outside_the_supported_range_warns(
    monkeypatch: pytest.MonkeyPatch, installed: str, warns: bool
) -> None:
    monkeypatch.setattr(_compat, "version", lambda _name: installed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.warn_if_unsupported()
    assert any(w.category is RuntimeWarning and installed in str(w.message) for w in caught) == warns


def test_an_old_policy_loss_signature_is_refused_with_the_supported_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def old_vanilla(
        old_log_prob: object,
        log_prob: object,
        advantages: object,
        response_mask: object,
        loss_agg_mode: object,
        config: object,
        rollout_log_probs: object,
    ) -> None:
        raise AssertionError("never called")

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vanilla", old_vanilla)
    monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, "per_rollout_mean")
    with pytest.raises(RuntimeError, match=r"rollout_log_probs.*>=0.7.1,<0.10"):
        _compat.register_policy_loss("per_rollout_mean", compute_policy_loss_per_rollout_mean)


@pytest.mark.parametrize("loss_mode", sorted(agl_verl.POLICY_LOSSES))
@pytest.mark.parametrize(("release", "keywords"), sorted(_compat.POLICY_LOSS_CALL_KEYWORDS.items()))
def test_our_losses_take_the_keyword_call_of_each_supported_release(
    release: tuple[int, ...], keywords: tuple[str, ...], loss_mode: str
) -> None:
    old, new, advantages, mask, weights = loss_inputs(release[1])
    values = {
        "old_log_prob": old,
        "log_prob": new,
        "advantages": advantages,
        "response_mask": mask,
        "loss_agg_mode": "token-mean",
        "config": actor_config(),
        "rollout_is_weights": weights,
    }
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]] = core_algos.get_policy_loss_fn(loss_mode)
    with rollout_index_context(torch.tensor([0, 0, 1, 2, 2, 2])):
        loss, metrics = loss_fn(**{k: values[k] for k in keywords})
    assert loss.shape == () and set(metrics) == {
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
    }


def test_the_installed_verl_calls_losses_as_recorded_for_its_release_line() -> None:
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    recorded = _compat.POLICY_LOSS_CALL_KEYWORDS[_compat.verl_version()[:2]]
    assert tuple(inspect.signature(vanilla).parameters) == recorded


def test_a_call_change_within_a_release_line_that_our_loss_accepts_warns_and_registers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def vanilla_without_weights(
        old_log_prob: object,
        log_prob: object,
        advantages: object,
        response_mask: object,
        loss_agg_mode: object,
        config: object,
    ) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(_compat, "version", lambda _name: "0.8.0")
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vanilla", vanilla_without_weights)
    monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, "per_rollout_mean")
    _compat.register_policy_loss("per_rollout_mean", compute_policy_loss_per_rollout_mean)
    assert core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"] is compute_policy_loss_per_rollout_mean
    assert "verl 0.8.0 calls policy losses with" in caplog.text


def engine_micro_batches(max_token_len: int) -> tuple[list[Any], list[list[int]], DataProto]:
    """A 5-row actor batch as the engine workers get it (no-padding TensorDict, dynamic batch size),
    with ``rollout_index`` rows 0, 1 in rollout 7, rows 2, 4 in rollout 2, row 3 in rollout 9, cut into
    micro-batches of at most ``max_token_len`` tokens by verl's own ``prepare_micro_batches``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(0)
    prompts, responses = (
        torch.randint(1, 50, (5, 3), generator=gen),
        torch.randint(1, 50, (5, 4), generator=gen),
    )
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    attention_mask = torch.cat((torch.ones(5, 3, dtype=torch.int64), response_mask), 1)
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.cat((prompts, responses), 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "old_log_probs": torch.randn(5, 4, generator=gen) * 0.1 - 1,
            "advantages": torch.randn(5, 4, generator=gen) * response_mask,
            agl_verl.ROLLOUT_INDEX_KEY: torch.tensor([7, 7, 2, 9, 2]),
        }
    )
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max_token_len,
    )
    micro_batches, rows = prepare_micro_batches(data)
    return micro_batches, rows, batch


@skip_unless(verl_has_token_sum(), TOKEN_SUM_REASON)  # verl 0.9's ppo_loss; 0.7/0.8 import flash_attn there
def test_rollout_index_loss_carries_each_micro_batchs_index_into_gspo_per_rollout() -> None:
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    config = actor_config(policy_loss={"loss_mode": "gspo_per_rollout"})
    wrapped = agl_verl.with_rollout_index(partial(ppo_loss, config=config))
    assert agl_verl.with_rollout_index(wrapped) is wrapped
    micro_batches, rows, batch = engine_micro_batches(max_token_len=16)
    assert len(micro_batches) > 1  # rows regrouped by length, so indices must travel with them
    gen = torch.Generator().manual_seed(1)
    for micro_batch, row_ids in zip(micro_batches, rows, strict=True):
        n_tokens = int(micro_batch["input_ids"].offsets()[-1])
        log_probs = torch.nested.nested_tensor_from_jagged(
            torch.randn(n_tokens, generator=gen) * 0.1 - 1, offsets=micro_batch["input_ids"].offsets()
        )
        loss, _ = wrapped(model_output={"log_probs": log_probs}, data=micro_batch)
        expected, _ = compute_policy_loss_gspo_per_rollout(
            batch.batch["old_log_probs"][row_ids],
            no_padding_2_padding(log_probs, micro_batch),
            batch.batch["advantages"][row_ids],
            batch.batch["response_mask"][row_ids].bool(),
            config=config,
            rollout_index=batch.batch[agl_verl.ROLLOUT_INDEX_KEY][row_ids],
        )
        torch.testing.assert_close(loss, expected)
        with pytest.raises(ValueError, match="RolloutIndexLoss"):
            ppo_loss(config, {"log_probs": log_probs}, micro_batch)
