"""Path 1 of the trainer: verl-managed vLLM replicas on the training GPUs (the reference's GPU path).

With ``agentlightning.external_servers.endpoints`` empty, the actor workers also take verl's rollout
role, and verl's hybrid engine starts one vLLM server replica per ``rollout.tensor_model_parallel_size``
GPUs, colocated with the actor. Agents reach them through the gateway, which the trainer points at
the replicas' addresses before every collection (stale registrations deleted first). Around each
update the replicas sleep, so FSDP gets their GPU memory, and wake with the new weights.

Needs GPUs and verl's vLLM extra; ``scripts/gpu-smoke.sh`` runs two steps of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from agl_trainer.serving.weights import ReplacesServedWeights
from agl_trainer.verl_glue.workers import PolicyWorkers

if TYPE_CHECKING:
    from omegaconf import DictConfig


class VerlReplicas(ReplacesServedWeights):
    """verl's vLLM replicas and the checkpoint engine that moves the actor's weights into them.

    Also the trainer's weight pusher on this path: :meth:`release` puts the replicas to sleep
    before training, :meth:`push` wakes them serving a given weight version. Both are no-ops when
    the replicas are already in that state, so the trainer may call them unconditionally.
    """

    def __init__(self, servers: Any, checkpoints: Any) -> None:
        self._servers = servers
        self._checkpoints = checkpoints
        # The version the replicas serve while awake; None while asleep. verl's replicas start
        # asleep, waiting for the first weight sync.
        self._serving: int | None = None

    @classmethod
    def start(cls, config: DictConfig, workers: PolicyWorkers) -> VerlReplicas:
        """Start the replicas on the actor workers' GPUs (``workers`` built with the rollout role);
        ``config`` is verl's, answering to the gateway's model name (:func:`agl_trainer.settings.replica_config`)."""
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        # verl's auto_await runs these coroutine methods to completion when called without await;
        # type checkers see coroutines, hence Any.
        servers: Any = LLMServerManager.create(
            config=config, worker_group=workers.actor, rollout_resource_pool=workers.pool
        )
        checkpoints: Any = CheckpointEngineManager(
            config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=workers.actor,
            replicas=servers.get_replicas(),
        )
        checkpoints.sleep_replicas()
        return cls(servers, checkpoints)

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every replica's OpenAI server, for the gateway's registrations."""
        return [str(address) for address in self._servers.get_addresses()]

    def release(self) -> None:
        """Sleep the replicas (weights and KV cache off the GPU) so training has the memory."""
        if self._serving is not None:
            self._checkpoints.sleep_replicas()
            self._serving = None

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Make every replica serve the actor's current weights as ``version``, awake.

        A sleeping replica has dropped its weights, so waking it always syncs them; an awake one
        already serving ``version`` is left alone.
        """
        if self._serving == version:
            return {"training/weight_version": float(version)}
        self.release()
        sync_metrics = self._checkpoints.update_weights(version) or {}
        self._serving = version
        numeric = {str(k): float(v) for k, v in sync_metrics.items() if isinstance(v, int | float)}
        return {**numeric, "training/weight_version": float(version)}

    def shutdown(self) -> None:
        """Stop every server actor of every replica (one per node it spans) and verl's load balancer.

        The actor workers, which host the replicas' engines, are stopped with their group.
        """
        for replica in self._servers.get_replicas():
            for handle in replica.servers:
                ray.kill(handle)
        ray.kill(self._servers.global_load_balancer)


__all__ = ("VerlReplicas",)
