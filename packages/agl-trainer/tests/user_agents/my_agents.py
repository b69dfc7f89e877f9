"""An agent written from the README's table alone, as a user would: the fixture of
``test_trainer_local_own_agent.py``, imported by agl-controller's workers through ``PYTHONPATH``.

It needs only httpx (which the agl-server environment has) and reads its prompt from ``PROMPT``
(``+agentlightning.local.env_map.PROMPT=input.prompt``).
"""

from __future__ import annotations

import os
import time

import httpx

MAX_TOKENS = 8
MODEL = "agl-local-policy"


class DigitAgent:
    """Two turns through the gateway; the reward is the share of digits in what the model wrote."""

    def run(self) -> None:
        base = os.environ["AGL_OPENAI_BASE_URL"]
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        with httpx.Client(headers=headers, timeout=120) as http:
            prompt = os.environ["PROMPT"]
            first = self.complete(http, base, prompt)
            second = self.complete(http, base, f"{prompt}{first}\nAgain:")
            written = first + second
            reward = sum(char.isdigit() for char in written) / max(1, len(written))
            http.post(
                os.environ["AGL_EVENT_URL"], json={"event_type": "reward", "data": {"value": reward}}
            ).raise_for_status()

    @staticmethod
    def complete(http: httpx.Client, base: str, prompt: str) -> str:
        """One completion; a 429 (the trainer is pushing weights) is retried after its Retry-After."""
        while True:
            response = http.post(
                f"{base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
            )
            if response.status_code != 429:
                response.raise_for_status()
                return str(response.json()["choices"][0]["text"])
            time.sleep(float(response.headers.get("Retry-After", "1")))
