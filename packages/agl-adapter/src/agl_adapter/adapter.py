"""``RolloutAdapter``: completed rollouts → one verl training batch, and validation metrics.

Differences from the reference adapter, on purpose: ``token_level_scores`` is float32 (the
reference's bfloat16 turns a reward of 0.1 into 0.10009765625); input triplets are never
mutated; ``training/n_trace_merge_mismatch_rows`` counts every prefix break while the entries
sent to the sink are capped separately; failed rollouts can be dropped and are counted either way.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import numpy as np
import torch

from agl_adapter._images import VisionEncoder
from agl_adapter._rows import (
    Group,
    PrefixBreak,
    TrainingRow,
    convert_turns,
    finish_row,
    trajectory_groups,
    transition_groups,
)
from agl_adapter.batch import AdapterBatch, assemble_batch
from agl_adapter.errors import EmptyBatchError, InvalidImagesError
from agl_adapter.mismatch import MismatchEntry, MismatchSink, cap_text, decode_ids, default_mismatch_sink
from agl_adapter.trajectories import (
    TRACE_MERGE_MISMATCHES,
    TRAIN_TRAJECTORIES,
    VALIDATION_TRAJECTORIES,
    ArtifactSink,
    trajectory_records,
)
from agl_types import CompletedRollout

if TYPE_CHECKING:
    from verl import DataProto

logger = logging.getLogger("agl_adapter")

TraceAggregatorLevel = Literal["transition", "trajectory"]
TRACE_AGGREGATOR_LEVELS: Final[tuple[str, ...]] = get_args(TraceAggregatorLevel)

Metrics = dict[str, float | int]


@dataclass
class _StepCounts:
    n_rollouts: int = 0
    n_failed: int = 0
    n_dropped_failed: int = 0
    n_with_trace: int = 0
    n_with_reward: int = 0
    n_truncated: int = 0
    n_skipped_empty_rows: int = 0
    n_empty_response_triplets: int = 0
    n_unmerged: int = 0
    n_prefix_breaks: int = 0
    n_image_rows_dropped: int = 0


def _positive(name: str, value: int) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _non_negative(name: str, value: int) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _by_step_and_sample(rollout: CompletedRollout) -> tuple[int, int]:
    return rollout.step, rollout.sample_idx_in_step


class RolloutAdapter:
    """Turns ``CompletedRollout``s into the padded tensors of one verl training batch.

    ``trace_aggregator_level``: ``"transition"`` gives one row per model call; ``"trajectory"``
    merges consecutive calls whose prompt continues the context so far, the extra prompt ids
    (tool observations) going to the response side with ``response_mask`` 0.
    ``drop_failed_rollouts``: FAILED rollouts (timed-out ones included) emit no rows; by default
    they are trained on like the reference does, with ``reward_fillna_value`` when rewardless.
    ``mismatch_sink``: where prefix-break entries go; None picks wandb or the log per step.
    ``artifact_sink``: receives each step's trajectory records (at most ``max_train_trajectories``
    training rollouts, every validation rollout; text capped at ``max_mismatch_text_chars``) and
    its mismatch entries; None writes none.
    ``require_routed_experts``: R3 routing replay is on, so every training row must carry its model
    calls' MoE routes (an InvalidRoutesError names the first row without); otherwise the batch has
    ``routed_experts`` only when every row has routes.
    ``processor``: the model's HF processor (verl's ``hf_processor``), for triplets with
    ``image_urls``: rows with images then carry ``multi_modal_inputs``, and with an mrope model
    (Qwen2/2.5/3-VL) the batch's ``position_ids`` are (N, 4, P+R). A row whose image placeholder
    tokens are not what its images expand to, or whose image does not load, is dropped with a
    warning naming the rollout and turn (``training/n_image_rows_dropped``); a row with images and
    no processor is an InvalidImagesError.
    """

    def __init__(
        self,
        *,
        max_prompt_length: int,
        max_response_length: int,
        pad_token_id: int,
        trace_aggregator_level: str = "trajectory",
        reward_fillna_value: float = 0.0,
        tokenizer: Any | None = None,
        device: torch.device | str = "cpu",
        drop_failed_rollouts: bool = False,
        mismatch_sink: MismatchSink | None = None,
        max_mismatch_entries: int = 100,
        max_mismatch_text_chars: int = 4000,
        artifact_sink: ArtifactSink | None = None,
        max_train_trajectories: int | None = 24,
        require_routed_experts: bool = False,
        processor: Any | None = None,
    ) -> None:
        if trace_aggregator_level not in TRACE_AGGREGATOR_LEVELS:
            raise ValueError(
                f"Unknown trace_aggregator_level: {trace_aggregator_level!r}; "
                f"supported: {list(TRACE_AGGREGATOR_LEVELS)}"
            )
        self.max_prompt_length = _positive("max_prompt_length", max_prompt_length)
        self.max_response_length = _positive("max_response_length", max_response_length)
        self.pad_token_id = _non_negative("pad_token_id", pad_token_id)
        self.trace_aggregator_level = trace_aggregator_level
        self.reward_fillna_value = float(reward_fillna_value)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.drop_failed_rollouts = drop_failed_rollouts
        self.mismatch_sink = mismatch_sink
        self.max_mismatch_entries = _non_negative("max_mismatch_entries", max_mismatch_entries)
        self.max_mismatch_text_chars = _positive("max_mismatch_text_chars", max_mismatch_text_chars)
        self.artifact_sink = artifact_sink
        if max_train_trajectories is not None:
            _non_negative("max_train_trajectories", max_train_trajectories)
        self.max_train_trajectories = max_train_trajectories
        self.require_routed_experts = require_routed_experts
        self.processor = processor

    @property
    def is_trajectory(self) -> bool:
        return self.trace_aggregator_level == "trajectory"

    def build_batch(
        self, completed_rollouts: Sequence[CompletedRollout], *, global_steps: int = 0
    ) -> tuple[AdapterBatch, Metrics]:
        """The verl-free batch and its ``training/*`` metrics; raises EmptyBatchError on zero rows.

        Rollouts are taken in (step, sample index) order, so GRPO siblings stay together
        whatever order they finished in.
        """
        counts = _StepCounts(n_rollouts=len(completed_rollouts))
        rewards: list[float] = []
        turn_lengths: list[int] = []
        rows: list[TrainingRow] = []
        entries: list[MismatchEntry] = []
        mismatched: set[str] = set()
        no_trace_ids: list[str] = []
        for rollout in sorted(completed_rollouts, key=_by_step_and_sample):
            if not rollout.succeeded:
                counts.n_failed += 1
                if self.drop_failed_rollouts:
                    counts.n_dropped_failed += 1
                    continue
            reward = self._filled_reward(rollout)
            rewards.append(reward)
            counts.n_with_reward += rollout.final_reward is not None
            if not rollout.triplets:
                no_trace_ids.append(rollout.rollout_id)
                continue
            counts.n_with_trace += 1
            lengths = [len(triplet.response_token_ids) for triplet in rollout.triplets]
            turn_lengths += lengths
            counts.n_empty_response_triplets += lengths.count(0)
            for group in self._groups(rollout, counts, entries, mismatched, global_steps):
                row = finish_row(
                    group,
                    rollout_id=rollout.rollout_id,
                    data_id=rollout.data_id,
                    reward=reward,
                    max_prompt_length=self.max_prompt_length,
                    max_response_length=self.max_response_length,
                )
                if row.n_trained_tokens == 0:
                    counts.n_skipped_empty_rows += 1
                    continue
                counts.n_truncated += row.response_truncated
                rows.append(row)
        if no_trace_ids:
            logger.warning(
                "%d training rollouts have no triplets and give no rows (first: %s)",
                len(no_trace_ids),
                ", ".join(no_trace_ids[:5]),
            )
        if entries:
            self._write_mismatches(entries, global_steps)
        if self.artifact_sink is not None:
            self._write_train_artifacts(
                self.artifact_sink, completed_rollouts, entries, mismatched, global_steps
            )
        if not rows:
            raise EmptyBatchError(self._empty_reason(counts, len(no_trace_ids)))
        vision = None if self.processor is None else VisionEncoder(self.processor)
        if vision is None:
            _refuse_images_without_processor(rows)
        batch = assemble_batch(
            rows,
            max_prompt_length=self.max_prompt_length,
            max_response_length=self.max_response_length,
            pad_token_id=self.pad_token_id,
            include_turn_index=not self.is_trajectory,
            require_routed_experts=self.require_routed_experts,
            vision=vision,
        )
        counts.n_image_rows_dropped = int(batch.is_drop_mask.sum()) - sum(row.is_drop for row in rows)
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        return batch, self._train_metrics(counts, rewards, turn_lengths, len(rows))

    def get_train_data_batch(
        self, completed_rollouts: Sequence[CompletedRollout], *, global_steps: int = 0
    ) -> tuple[DataProto | AdapterBatch, Metrics]:
        """``build_batch``, converted to verl's ``DataProto`` when verl is importable."""
        batch, metrics = self.build_batch(completed_rollouts, global_steps=global_steps)
        if importlib.util.find_spec("verl") is None:
            return batch, metrics
        return batch.to_data_proto(), metrics

    def get_test_metrics(
        self, completed_rollouts: Sequence[CompletedRollout], *, global_steps: int = 0
    ) -> Metrics:
        """``val/*`` metrics over every rollout (failed ones included); needs at least one with triplets."""
        rewards = [self._filled_reward(rollout) for rollout in completed_rollouts]
        if self.artifact_sink is not None:
            records = trajectory_records(
                completed_rollouts,
                global_steps=global_steps,
                tokenizer=self.tokenizer,
                reward_fillna_value=self.reward_fillna_value,
                mismatched=None,
                max_text_chars=self.max_mismatch_text_chars,
            )
            self._write_artifact(self.artifact_sink, VALIDATION_TRAJECTORIES, records, global_steps)
        traced = [rollout for rollout in completed_rollouts if rollout.triplets]
        if not traced:
            raise EmptyBatchError(
                f"get_test_metrics received zero completed rollouts with trace "
                f"(step {global_steps}, {len(completed_rollouts)} rollouts, none with triplets)"
            )
        totals = [sum(len(t.response_token_ids) for t in rollout.triplets) for rollout in traced]
        turns = [len(rollout.triplets) for rollout in traced]
        return {
            "val/reward": float(np.mean(rewards)),
            "val/n_rollouts": len(completed_rollouts),
            "val/n_rollouts_w_trace": len(traced),
            "val/n_rollouts_w_reward": sum(
                rollout.final_reward is not None for rollout in completed_rollouts
            ),
            "val/mean_response_length_per_turn": float(np.mean(np.divide(totals, turns))),
            "val/mean_total_response_length_per_rollout": float(np.mean(totals)),
            "val/turn_count": float(np.mean(turns)),
        }

    def _filled_reward(self, rollout: CompletedRollout) -> float:
        return self.reward_fillna_value if rollout.final_reward is None else rollout.final_reward

    def _groups(
        self,
        rollout: CompletedRollout,
        counts: _StepCounts,
        entries: list[MismatchEntry],
        mismatched: set[str],
        global_steps: int,
    ) -> list[Group]:
        turns = convert_turns(rollout.triplets, rollout.rollout_id)
        if not self.is_trajectory:
            return transition_groups(turns)
        groups, breaks = trajectory_groups(turns)
        counts.n_unmerged += len(groups) > 1
        counts.n_prefix_breaks += len(breaks)
        if breaks:
            mismatched.add(rollout.rollout_id)
        room = self.max_mismatch_entries - len(entries)
        entries += (self._mismatch_entry(b, rollout, global_steps) for b in breaks[: max(room, 0)])
        return groups

    def _mismatch_entry(
        self, brk: PrefixBreak, rollout: CompletedRollout, global_steps: int
    ) -> MismatchEntry:
        previous = np.concatenate((brk.previous.prompt, brk.previous.response)).tolist()
        current = np.concatenate((brk.current.prompt, brk.current.response)).tolist()
        return MismatchEntry(
            global_steps=global_steps,
            rollout_id=rollout.rollout_id,
            data_id=rollout.data_id,
            turn_index=brk.current.index,
            template_mismatch=False,
            retoken_mismatch=False,
            others_mismatch=True,
            prompt_length=len(brk.current.prompt),
            response_length=len(brk.current.response),
            previous_trace_length=len(previous),
            current_trace_length=len(current),
            previous_trace=cap_text(decode_ids(self.tokenizer, previous), self.max_mismatch_text_chars),
            current_trace=cap_text(decode_ids(self.tokenizer, current), self.max_mismatch_text_chars),
        )

    def _write_mismatches(self, entries: list[MismatchEntry], global_steps: int) -> None:
        sink = self.mismatch_sink if self.mismatch_sink is not None else default_mismatch_sink()
        try:
            sink.write(entries, global_steps)
        except Exception as exc:  # a broken sink must not cost the training step
            logger.warning("failed to write %d trace-merge mismatches to %r: %s", len(entries), sink, exc)

    def _write_train_artifacts(
        self,
        sink: ArtifactSink,
        rollouts: Sequence[CompletedRollout],
        entries: list[MismatchEntry],
        mismatched: set[str],
        global_steps: int,
    ) -> None:
        records = trajectory_records(
            rollouts,
            global_steps=global_steps,
            tokenizer=self.tokenizer,
            reward_fillna_value=self.reward_fillna_value,
            mismatched=frozenset(mismatched) if self.is_trajectory else None,
            max_text_chars=self.max_mismatch_text_chars,
            limit=self.max_train_trajectories,
        )
        self._write_artifact(sink, TRAIN_TRAJECTORIES, records, global_steps)
        if entries:
            self._write_artifact(sink, TRACE_MERGE_MISMATCHES, entries, global_steps)

    @staticmethod
    def _write_artifact(
        sink: ArtifactSink, kind: str, records: Sequence[Mapping[str, Any]], global_steps: int
    ) -> None:
        try:
            sink.write(kind, records, global_steps)
        except Exception as exc:  # like the mismatch sink: a full disk must not cost the training step
            logger.warning("step %d: failed to write %s to %r: %s", global_steps, kind, sink, exc)

    def _empty_reason(self, counts: _StepCounts, n_without_trace: int) -> str:
        return (
            f"get_train_data_batch emitted zero training rows: {counts.n_rollouts} rollouts, "
            f"{counts.n_dropped_failed} dropped as failed, {n_without_trace} without triplets, "
            f"{counts.n_skipped_empty_rows} rows without model tokens "
            f"({counts.n_empty_response_triplets} triplets with empty responses). "
            "Check that the agents' model calls go through the gateway's proxy so their token ids are recorded."
        )

    def _train_metrics(
        self, counts: _StepCounts, rewards: list[float], turn_lengths: list[int], n_rows: int
    ) -> Metrics:
        metrics: Metrics = {
            "training/reward": float(np.mean(rewards)) if rewards else 0.0,
            "training/n_sample": n_rows,
            "training/n_rollouts": counts.n_rollouts,
            "training/n_rollouts_w_trace": counts.n_with_trace,
            "training/n_rollouts_w_reward": counts.n_with_reward,
            "training/n_failed_rollouts": counts.n_failed,
            "training/n_dropped_failed_rollouts": counts.n_dropped_failed,
            "training/n_truncated_sample": counts.n_truncated,
            "training/n_skipped_empty_rows": counts.n_skipped_empty_rows,
            "training/n_empty_response_triplets": counts.n_empty_response_triplets,
            "training/n_turns": len(turn_lengths),
            "response_length/training/avg_by_turn": float(np.mean(turn_lengths)),
            "response_length/training/max_by_turn": max(turn_lengths),
            "response_length/training/min_by_turn": min(turn_lengths),
        }
        if self.processor is not None:
            metrics["training/n_image_rows_dropped"] = counts.n_image_rows_dropped
        if self.is_trajectory:
            metrics["training/n_unmerged_rollouts"] = counts.n_unmerged
            metrics["training/n_trace_merge_mismatch_rows"] = counts.n_prefix_breaks
        return metrics


def _refuse_images_without_processor(rows: Sequence[TrainingRow]) -> None:
    row = next((row for row in rows if row.image_urls and not row.is_drop), None)
    if row is not None:
        raise InvalidImagesError(
            f"rollout {row.rollout_id!r} turn {row.images_turn} has {len(row.image_urls or ())} image(s) but "
            "the adapter has no processor: pass RolloutAdapter(processor=...) (verl's hf_processor of a "
            "vision-language model), or keep images out of the agents' model calls"
        )


__all__ = ("TRACE_AGGREGATOR_LEVELS", "Metrics", "RolloutAdapter", "TraceAggregatorLevel")
