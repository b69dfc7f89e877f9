"""Root conftest: makes the shared fixtures of ``tests/agl_testing`` available to every package."""

pytest_plugins = ("agl_testing.agl_server",)
