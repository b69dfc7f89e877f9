"""Root conftest: loaded by every pass of the test command (the workspace and each package's
own venv). It makes the shared fixtures of ``tests/agl_testing`` available to every package and
loads the plugins that select the Hypothesis profile, gate skips under ``CI=true``, and run each
test once per test command."""

import os

# Under `uv run pytest`, Ray (>= 2.47) would start every worker with `uv run` inside a copy of
# the project that has no venv (the .gitignore'd .venv is not copied), and the workers die with
# "No module named 'ray'". Ray reads this when it is imported, so it is set before any test
# module imports it; agl_trainer.verl_glue.workers sets the same for the workers' own children.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

pytest_plugins = (
    "agl_testing.agl_server",
    "agl_testing.ci_gate",
    "agl_testing.ray_cluster",
    "agl_testing.run_once",
    "agl_testing.vllm_server",
)
