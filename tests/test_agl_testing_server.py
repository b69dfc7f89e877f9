"""Where the agl-server fixture finds the server, and what it says when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_testing.agl_server import find_agl_server, require_agl_server
from agl_trainer.local.envs import agl_server_spec, cache_dir


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment where no agl-server can be found; returns the cache root it points at."""
    for name in ("AGL_SERVER_BIN", "AGL_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path / "cache"


@pytest.mark.parametrize("variable", ["AGL_CACHE_DIR", "XDG_CACHE_HOME"])
def test_agl_server_is_found_where_the_trainer_provisions_it(
    no_server: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str
) -> None:
    monkeypatch.delenv("AGL_CACHE_DIR")
    monkeypatch.setenv(variable, str(tmp_path / "elsewhere"))
    executable = cache_dir() / "envs" / agl_server_spec().name / "bin" / "agl-server"
    executable.parent.mkdir(parents=True)
    executable.touch(mode=0o755)
    assert find_agl_server() == executable


def test_missing_agl_server_fails_under_ci_naming_the_fix(
    no_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as err:
        require_agl_server()
    assert str(err.value) == (
        f"agl-server not found in {no_server / 'envs' / 'agl-server'} nor on PATH: run "
        "`python -m agl_trainer.local.provision agl-server` or set AGL_SERVER_BIN "
        "(CI=true: CI provisions it, so this is a failure)"
    )


def test_agl_server_bin_that_is_not_a_file_is_named(
    no_server: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CI", "false")
    monkeypatch.setenv("AGL_SERVER_BIN", str(tmp_path / "nowhere"))
    with pytest.raises(pytest.skip.Exception) as err:
        require_agl_server()
    assert str(err.value) == f"AGL_SERVER_BIN={tmp_path / 'nowhere'} is not a file"
