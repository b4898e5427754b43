"""The wheel installs one namespace: kvscope.* resolves and nothing generic lands top-level.

kvscope is installed into vLLM's serving environment as a plugin, so a top-level `tracer` or
`analysis` would shadow (or be shadowed by) other distributions of those names. The wheel is
built from the working tree, installed without dependencies into a fresh venv that sees the
project venv's site-packages (a .pth line: its .pth files, kvscope's editable finder among
them, are not run), and inspected from there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLD_TOP_LEVEL = ("analysis", "tracer", "probes", "dashboards", "patched_backend", "contract",
                 "exports", "testkit")
GROUPS = ("vllm.general_plugins", "opentelemetry_instrumentor", "console_scripts")
INSPECT = """
import importlib, importlib.metadata as md, importlib.util, json, sys
from kvscope.patched_backend.parallel_disk import lmcache_config
from kvscope.contract import rundir
from kvscope.analysis import acceptance
from kvscope.dashboards import app
eps = {g: {ep.name: (ep.value, str(ep.dist.locate_file(""))) for ep in md.entry_points(group=g)
           if ep.dist.name == "kvscope"} for g in sys.argv[1:]}
loaded = [ep.name for g in ("vllm.general_plugins", "opentelemetry_instrumentor")
          for ep in md.entry_points(group=g) if ep.dist.name == "kvscope" and callable(ep.load())]
print(json.dumps({
    "top_level": [n for n in %r if importlib.util.find_spec(n) is not None],
    "lmcache_module": importlib.util.find_spec(lmcache_config.MODULE).origin,
    "contract": rundir.__file__, "entry_points": eps, "loaded": loaded,
    "data": [str(acceptance.EXAMPLE), *map(str, app.ASSETS.glob("*.css"))],
}))
""" % (OLD_TOP_LEVEL,)


def _copy_sources(dest: Path) -> None:
    """pyproject, README, kvscope/ with its room links, and every room, as they are now."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "kvscope", dest / "kvscope", symlinks=True, ignore=ignore)
    for link in (ROOT / "kvscope").iterdir():
        if link.is_symlink():
            shutil.copytree(link.resolve(), dest / link.resolve().name, ignore=ignore)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(the fresh venv, what INSPECT printed in it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    (tmp / "src").mkdir()
    _copy_sources(tmp / "src")
    # built as pip builds it for any user: in an isolated environment with pyproject's backend
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp / "dist"), str(tmp / "src")], check=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("kvscope-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp)
    target = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    project = [p for p in sys.path if Path(p).name == "site-packages"]
    (target / "project-venv.pth").write_text("\n".join(project) + "\n")
    out = subprocess.run([python, "-I", "-c", INSPECT, *GROUPS], cwd=tmp, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return venv, json.loads(out.stdout)


def test_no_generic_top_level_module_is_installed(installed):
    venv, found = installed
    assert found["top_level"] == []
    assert Path(found["contract"]).is_relative_to(venv)


def test_entry_points_name_the_namespace_and_resolve_in_the_wheel(installed):
    venv, found = installed
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = {"vllm.general_plugins": declared["entry-points"]["vllm.general_plugins"],
            "opentelemetry_instrumentor": declared["entry-points"]["opentelemetry_instrumentor"],
            "console_scripts": declared["scripts"]}
    assert {g: {n: v for n, (v, _) in eps.items()} for g, eps in found["entry_points"].items()} \
        == want
    assert all(v.startswith("kvscope.") for group in want.values() for v in group.values())
    assert all(Path(where).is_relative_to(venv)
               for eps in found["entry_points"].values() for _, where in eps.values())
    assert sorted(found["loaded"]) == sorted([*want["vllm.general_plugins"],
                                              *want["opentelemetry_instrumentor"]])


def test_lmcache_finds_the_backend_module_in_the_wheel(installed):
    venv, found = installed
    assert Path(found["lmcache_module"]).is_relative_to(venv)


def test_package_data_ships_in_the_wheel(installed):
    """The demo's gate file and the dashboard's stylesheet, read from beside their modules."""
    venv, found = installed
    assert len(found["data"]) >= 2
    assert all(Path(p).is_relative_to(venv) and Path(p).is_file() for p in found["data"])


def test_the_console_script_runs(installed):
    venv, _ = installed
    out = subprocess.run([venv / "bin" / "kvscope", "--help"], capture_output=True, text=True,
                         check=True)
    assert "analyze" in out.stdout
