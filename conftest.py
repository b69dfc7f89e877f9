"""Root conftest: loaded by every pass of the test command (the workspace and each package's
own venv). It makes the shared fixtures of ``tests/agl_testing`` available to every package and
loads the plugin that selects the Hypothesis profile and gates skips under ``CI=true``."""

pytest_plugins = ("agl_testing.agl_server", "agl_testing.ci_gate")
