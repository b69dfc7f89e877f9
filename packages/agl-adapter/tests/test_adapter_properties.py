"""Hypothesis-generated multi-turn traces: invariants, and exact agreement with a naive list implementation.

Token ids are unique per role (prompt starts 9000+, model tokens 1000+, observations 5000+), so
where each token lands in the batch can be checked without re-deriving the merge.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agl_adapter import AdapterBatch, RolloutAdapter
from agl_types import CompletedRollout, RolloutState, Triplet

PAD = 0
MODEL, OBSERVATION, PROMPT = range(1000, 5000), range(5000, 9000), range(9000, 20000)


class _NullSink:
    def write(self, entries: object, global_steps: int) -> None:
        return None


@dataclass
class _Expected:
    """What the generator knows about one rollout: its groups of merged turns."""

    groups: list[list[tuple[list[int], bool]]] = field(default_factory=list)  # (piece, is_model) per group
    prompts: list[list[int]] = field(default_factory=list)  # each group's first prompt
    n_breaks: int = 0


@dataclass
class _Case:
    rollouts: list[CompletedRollout]
    expected: list[_Expected]
    p: int
    r: int
    level: str


@st.composite
def _cases(draw: st.DrawFn) -> _Case:
    counters = {"m": iter(MODEL), "o": iter(OBSERVATION), "p": iter(PROMPT)}

    def fresh(kind: str, n: int) -> list[int]:
        return list(itertools.islice(counters[kind], n))

    level = draw(st.sampled_from(["trajectory", "transition"]))
    p, r = draw(st.integers(1, 10)), draw(st.integers(1, 14))
    rollouts: list[CompletedRollout] = []
    expected: list[_Expected] = []
    for i in range(draw(st.integers(1, 4))):
        exp = _Expected()
        triplets: list[Triplet] = []
        context: list[int] = []
        for k in range(draw(st.integers(1, 6))):
            breaks = k == 0 or draw(st.booleans())
            observation: list[int] = []
            if breaks:
                prompt = fresh("p", draw(st.integers(0 if k == 0 else 1, 6)))
            else:
                observation = fresh("o", draw(st.integers(0, 4)))
                prompt = context + observation
            response = fresh("m", draw(st.integers(0, 5)))
            log_probs = [-0.5 - j for j in range(len(response))] if draw(st.integers(0, 4)) else None
            version = draw(st.one_of(st.none(), st.integers(0, 3)))
            triplets.append(
                Triplet(
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_log_probs=log_probs,
                    metadata={} if version is None else {"server": {"version": version}},
                )
            )
            if level == "transition":
                exp.groups.append([(response, True)])
                exp.prompts.append(prompt)
            elif k > 0 and (not breaks or not context):  # a fresh prompt continues an empty context
                exp.groups[-1] += [(prompt[len(context) :], False), (response, True)]
            else:
                exp.n_breaks += k > 0
                exp.groups.append([(response, True)])
                exp.prompts.append(prompt)
            context = prompt + response
        reward = draw(st.one_of(st.none(), st.floats(-2, 2, width=32)))
        rollouts.append(
            CompletedRollout(
                rollout_id=f"r{i}",
                data_id=f"d{i // 2}",
                step=0,
                sample_idx_in_step=i,
                enqueue_time=0.0,
                final_reward=reward,
                triplets=triplets,
                rollout_state=RolloutState.SUCCEEDED,
            )
        )
        expected.append(exp)
    return _Case(rollouts, expected, p, r, level)


def _adapter(case: _Case) -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=case.p,
        max_response_length=case.r,
        pad_token_id=PAD,
        trace_aggregator_level=case.level,
        mismatch_sink=_NullSink(),
    )


def _build(case: _Case) -> tuple[AdapterBatch, dict[str, float | int]]:
    """The adapter's batch; a case whose every row is cut to no model token is discarded (the
    adapter raises for it, which other tests check), so Hypothesis counts it as filtered."""
    expected_rows = sum(
        any(m and piece for piece, m in _cut(group, case.r)) for e in case.expected for group in e.groups
    )
    assume(expected_rows > 0)
    return _adapter(case).build_batch(case.rollouts)


def _cut(group: list[tuple[list[int], bool]], r: int) -> list[tuple[list[int], bool]]:
    """The group's pieces cut to the first r response tokens."""
    out: list[tuple[list[int], bool]] = []
    left = r
    for piece, is_model in group:
        out.append((piece[:left], is_model))
        left -= len(out[-1][0])
    return out


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_every_surviving_model_token_appears_once_with_mask_one(case: _Case) -> None:
    batch, _ = _build(case)
    surviving = Counter(
        token for e in case.expected for g in e.groups for piece, m in _cut(g, case.r) if m for token in piece
    )
    trained = batch.responses[batch.response_mask.bool()].tolist()
    # rows without any model token are skipped; their tokens are none anyway
    assert Counter(trained) == surviving
    assert all(t in MODEL for t in trained)


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_observation_tokens_have_mask_zero(case: _Case) -> None:
    batch, _ = _build(case)
    is_observation = (batch.responses >= OBSERVATION.start) & (batch.responses < OBSERVATION.stop)
    assert not batch.response_mask[is_observation].any()
    if case.level == "trajectory":
        expected = Counter(
            token
            for e in case.expected
            for g in e.groups
            if any(m and piece for piece, m in _cut(g, case.r))
            for piece, m in _cut(g, case.r)
            if not m
            for token in piece
        )
        # observation pieces: the extra prompt ids (fresh prompt ids when the context was empty)
        untrained = (batch.attention_mask[:, case.p :] == 1) & (batch.response_mask == 0)
        assert Counter(batch.responses[untrained].tolist()) == expected
    else:
        assert not is_observation.any()


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_reward_sits_on_the_last_valid_token_and_positions_follow_the_mask(case: _Case) -> None:
    batch, _ = _build(case)
    p = case.p
    n_response = batch.attention_mask[:, p:].sum(dim=1)
    rewards = {
        r.rollout_id: np.float32(0.0 if r.final_reward is None else r.final_reward).item()
        for r in case.rollouts
    }
    expected = torch.zeros_like(batch.token_level_scores)
    for i, rollout_id in enumerate(batch.rollout_id_list.tolist()):
        expected[i, int(n_response[i]) - 1] = rewards[rollout_id]
    assert torch.equal(batch.token_level_scores, expected)
    cumsum = torch.clamp(torch.cumsum(batch.attention_mask, dim=1) - 1, min=0)
    assert torch.equal(batch.position_ids, cumsum)
    pad = batch.attention_mask == 0
    assert torch.equal(batch.input_ids[pad], torch.full_like(batch.input_ids[pad], PAD))


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_k_prefix_breaks_give_k_plus_one_rows(case: _Case) -> None:
    batch, metrics = _build(case)
    n_groups = sum(len(e.groups) for e in case.expected)
    assert len(batch) + metrics["training/n_skipped_empty_rows"] == n_groups
    if case.level == "trajectory":
        assert all(len(e.groups) == e.n_breaks + 1 for e in case.expected)
        assert metrics["training/n_trace_merge_mismatch_rows"] == sum(e.n_breaks for e in case.expected)
        assert metrics["training/n_unmerged_rollouts"] == sum(e.n_breaks > 0 for e in case.expected)


def _naive(case: _Case) -> dict[str, Any]:
    """The spec's algorithm, row by row on Python lists (SPEC §4.2 steps 3-8, float32 scores)."""
    p, r = case.p, case.r
    rows: list[dict[str, Any]] = []
    for rollout in sorted(case.rollouts, key=lambda x: (x.step, x.sample_idx_in_step)):
        reward = 0.0 if rollout.final_reward is None else rollout.final_reward
        groups: list[dict[str, Any]] = []
        context: list[int] = []
        for k, t in enumerate(rollout.triplets):
            prompt, response, lps = t.prompt_token_ids, t.response_token_ids, t.response_log_probs
            version = t.metadata.get("server", {}).get("version", -1)
            if case.level == "trajectory" and k > 0 and prompt[: len(context)] == context:
                g = groups[-1]
                obs = prompt[len(context) :]
                g["resp"] = g["resp"] + obs + response
                g["mask"] = g["mask"] + [0] * len(obs) + [1] * len(response)
                g["ver"] = g["ver"] + [version] * (len(obs) + len(response))
                if g["lp"] is not None:
                    g["lp"] = None if lps is None else g["lp"] + [0.0] * len(obs) + list(lps)
            else:
                groups.append(
                    {
                        "prompt": list(prompt),
                        "resp": list(response),
                        "mask": [1] * len(response),
                        "lp": None if lps is None else list(lps),
                        "ver": [version] * len(response),
                        "turn": k,
                    }
                )
            context = list(prompt) + list(response)
        for g in groups:
            resp, mask, lp = g["resp"][:r], g["mask"][:r], None if g["lp"] is None else g["lp"][:r]
            if sum(mask) == 0:
                continue
            prompt = g["prompt"][:p]
            rows.append(
                {
                    "prompts": [PAD] * (p - len(prompt)) + prompt,
                    "prompt_attn": [0] * (p - len(prompt)) + [1] * len(prompt),
                    "responses": resp + [PAD] * (r - len(resp)),
                    "resp_attn": [1] * len(resp) + [0] * (r - len(resp)),
                    "response_mask": mask + [0] * (r - len(mask)),
                    "lp": None if lp is None else lp + [0.0] * (r - len(lp)),
                    "ver": g["ver"][:r] + [-1] * (r - len(resp)),
                    "drop": len(g["prompt"]) > p,
                    "scores": [0.0] * (len(resp) - 1) + [reward] + [0.0] * (r - len(resp)),
                    "rollout_id": rollout.rollout_id,
                    "turn": g["turn"],
                }
            )
    attn = torch.tensor([row["prompt_attn"] + row["resp_attn"] for row in rows])
    out: dict[str, Any] = {
        "prompts": torch.tensor([row["prompts"] for row in rows]),
        "responses": torch.tensor([row["responses"] for row in rows]),
        "attention_mask": attn,
        "position_ids": torch.clamp(torch.cumsum(attn, dim=1) - 1, min=0),
        "response_mask": torch.tensor([row["response_mask"] for row in rows]),
        "is_drop_mask": torch.tensor([row["drop"] for row in rows]),
        "token_level_scores": torch.tensor([row["scores"] for row in rows], dtype=torch.float32),
        "response_weight_versions": torch.tensor([row["ver"] for row in rows]),
        "rollout_id_list": [row["rollout_id"] for row in rows],
        "turn_index_list": [row["turn"] for row in rows],
    }
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    if all(row["lp"] is not None for row in rows):
        out["rollout_log_probs"] = torch.tensor([row["lp"] for row in rows], dtype=torch.float32)
    return out


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_tensors_equal_the_naive_list_implementation(case: _Case) -> None:
    batch, _ = _build(case)
    naive = _naive(case)
    tensors = batch.tensors()
    assert set(tensors) == {k for k in naive if isinstance(naive[k], torch.Tensor)}
    for key, tensor in tensors.items():
        assert tensor.dtype == naive[key].dtype, key
        assert torch.equal(tensor, naive[key]), key
    assert batch.rollout_id_list.tolist() == naive["rollout_id_list"]
    if case.level == "transition":
        assert batch.turn_index_list is not None
        assert batch.turn_index_list.tolist() == naive["turn_index_list"]
