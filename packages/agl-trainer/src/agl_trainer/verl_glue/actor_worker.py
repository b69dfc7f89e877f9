"""``AglActorRefWorker``: verl's actor/ref worker plus the methods agl's start-up and weight push call.

A module of its own so that imports run one way: :mod:`agl_trainer.verl_glue.workers` (which builds the
worker groups) imports :mod:`agl_trainer.verl_glue.cpu_platform` (which subclasses this worker for the CPU
mode), and both import this module.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.engine_workers import ActorRolloutRefWorker

from agl_algos.verl import with_rollout_index

__all__ = ("AglActorRefWorker",)

# verl's Dispatch is a dynamic enum whose members type checkers cannot see.
_ONE_TO_ALL: Any = Dispatch.ONE_TO_ALL  # pyright: ignore[reportAttributeAccessIssue]

# Files of a Hugging Face model folder copied next to pushed weights (config, tokenizer, template).
_HF_SIDE_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


class AglActorRefWorker(ActorRolloutRefWorker):
    """verl's actor/ref worker plus what agl's external-server path and start-up checks need."""

    @register(dispatch_mode=_ONE_TO_ALL)
    def init_model(self) -> None:
        """verl's, then the actor's loss function reads each micro-batch's ``rollout_index`` (for
        ``gspo_per_rollout``; a micro-batch without one leaves every other loss unchanged)."""
        super().init_model()
        if self.actor is not None:
            self.loss_fn = with_rollout_index(self.loss_fn)
            self.actor.set_loss_fn(self.loss_fn)

    @register(dispatch_mode=_ONE_TO_ALL)
    def save_hf_weights(self, path: str) -> int:
        """Save the actor's full weights as a Hugging Face folder at ``path``; return the tensor count.

        Every rank takes part in gathering the sharded weights; rank 0 writes
        ``model.safetensors`` plus the config and tokenizer files of the original model folder, so
        that vLLM (``reload_weights`` with ``weights_path``) or transformers can load the folder.
        """
        if self.actor is None:
            raise RuntimeError("save_hf_weights needs role 'actor'; this worker has role " + repr(self.role))
        from safetensors.torch import save_file

        is_writer = torch.distributed.get_rank() == 0
        per_tensor, _ = self.actor.engine.get_per_tensor_param()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in per_tensor:
            if is_writer:
                state[name] = tensor.detach().to("cpu").contiguous()
        count = len(state)
        if is_writer:
            target = Path(path)
            target.mkdir(parents=True, exist_ok=True)
            _copy_hf_side_files(Path(self.actor.model_config.local_path), target)
            partial = target / "model.safetensors.partial"
            save_file(state, str(partial), metadata={"format": "pt"})
            os.replace(partial, target / "model.safetensors")
        torch.distributed.barrier()
        return count

    @register(dispatch_mode=_ONE_TO_ALL)
    def save_lora_adapter(self, path: str) -> int:
        """Save the actor's LoRA adapter as a PEFT folder at ``path``; return the tensor count.

        ``adapter_model.safetensors`` holds the adapter's tensors under PEFT's names (the adapter's
        own name left out), ``adapter_config.json`` its rank, alpha and target modules: what PEFT
        and vLLM's runtime LoRA loading read. Every rank gathers its shards; rank 0 writes.
        """
        if self.actor is None:
            raise RuntimeError(
                "save_lora_adapter needs role 'actor'; this worker has role " + repr(self.role)
            )
        from peft.utils.save_and_load import get_peft_model_state_dict
        from safetensors.torch import save_file

        engine: Any = self.actor.engine  # verl's FSDP engine (its base class does not declare the module)
        module = engine.module
        peft_model = getattr(module, "_fsdp_wrapped_module", module)
        if not hasattr(peft_model, "peft_config"):
            raise RuntimeError("the actor has no LoRA adapter: set actor_rollout_ref.model.lora_rank > 0")
        gathered = {
            name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)
            .detach()
            .to("cpu")
            .contiguous()
            for name, tensor in module.state_dict().items()
            if "lora_" in name
        }
        if torch.distributed.get_rank() == 0:
            target = Path(path)
            target.mkdir(parents=True, exist_ok=True)
            peft_model.peft_config["default"].save_pretrained(str(target))
            partial = target / "adapter_model.safetensors.partial"
            save_file(
                get_peft_model_state_dict(peft_model, state_dict=gathered),
                str(partial),
                metadata={"format": "pt"},
            )
            os.replace(partial, target / "adapter_model.safetensors")
        torch.distributed.barrier()
        return len(gathered)

    @register(dispatch_mode=_ONE_TO_ALL)
    def describe_policy_loss(self) -> str:
        """``module.qualname`` of the policy-loss function this worker's verl resolves for its config.

        The trainer checks it at start-up: a custom loss mode registered in the driver but not in
        the workers (a missing setup hook) would otherwise fail only at the first update.
        """
        loss_fn = get_policy_loss_fn(self.config.actor.policy_loss.loss_mode)
        return f"{loss_fn.__module__}.{loss_fn.__qualname__}"


def _copy_hf_side_files(source: Path, target: Path) -> None:
    for item in source.iterdir():
        is_index = item.name.endswith(".index.json")
        if item.is_file() and item.suffix in _HF_SIDE_FILE_SUFFIXES and not is_index:
            shutil.copy2(item, target / item.name)
