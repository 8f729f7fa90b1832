"""The package as a user gets it: ``pip install ./python`` into a fresh
virtual environment, and the wheel ``python -m build`` makes into another;
in each, the README's "From Python" snippet runs against a real gateway
(from a folder where the source tree is not importable)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path
from typing import Any, Dict

import pytest

from conftest import PYTHON_DIR, REPO, worker_command, worker_env


def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's From Python section shows Python"
    return str(blocks[0])


def fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin" / "python"


def pip(python: Path, *args: str) -> None:
    out = subprocess.run([str(python), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def run_snippet(python: Path, gw: Any, cwd: Path) -> str:
    code = readme_snippet().replace("http://127.0.0.1:8080", gw.url)
    env: Dict[str, str] = {k: v for k, v in os.environ.items()
                           if not k.startswith("WARMGATE_") and k != "PYTHONPATH"}
    # The gateway made its own admin token and published it here; the
    # client finds it as the CLI does.
    env["WARMGATE_RUNTIME_DIR"] = str(gw.runtime_dir)
    out = subprocess.run([str(python), "-c", code], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def gw() -> Any:
    from conftest import Gateway

    g = Gateway(f"""
[[pools]]
name = "rollouts"
command = {worker_command()}
env = {worker_env()}
replicas = [1, 2]
concurrency = 8
""")
    try:
        g.wait_pool_ready("rollouts", 1)
        yield g
    finally:
        g.stop()


def test_pip_install_dot_python_in_a_fresh_venv_runs_the_readme_snippet(gw: Any) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="warmgate-py-venv-"))
    try:
        python = fresh_venv(tmp / "venv")
        # As the README says, from the repository's root.
        out = subprocess.run([str(python), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", "./python"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        printed = run_snippet(python, gw, tmp)
        assert printed.strip(), printed
        where = subprocess.run(
            [str(python), "-c", "import warmgate, warmgate.worker; print(warmgate.__file__)"],
            cwd=tmp, capture_output=True, text=True, check=True).stdout
        assert str(tmp / "venv") in where, where
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_wheel_installs_typed_and_runs_the_readme_snippet(gw: Any) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="warmgate-py-wheel-"))
    try:
        out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir",
                              str(tmp / "dist"), str(PYTHON_DIR)],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        wheels = list((tmp / "dist").glob("warmgate-*.whl"))
        assert len(wheels) == 1, wheels
        names = zipfile.ZipFile(wheels[0]).namelist()
        for f in ("warmgate/__init__.py", "warmgate/py.typed", "warmgate/client.py",
                  "warmgate/aio.py", "warmgate/errors.py", "warmgate/worker.py",
                  "warmgate/safetensors.py"):
            assert f in names, names
        python = fresh_venv(tmp / "venv")
        pip(python, str(wheels[0]))
        printed = run_snippet(python, gw, tmp)
        assert printed.strip(), printed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
