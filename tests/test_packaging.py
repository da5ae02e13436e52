"""PyTorch is an extra: ``subquad.jax`` and ``subquad --version`` work without it, the rest says what to install.

Each check runs in a fresh interpreter. "Without torch" is simulated by a ``sitecustomize`` on
``PYTHONPATH`` that puts a finder in front of ``sys.meta_path`` refusing ``torch`` and ``torch.*``,
as an environment without torch would (``.ci/jax-without-torch`` checks a real one, from the wheel).
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional

import pytest

import subquad

BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)
BROKEN_TORCH = textwrap.dedent(
    """
    import sys

    class _BrokenTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                raise ImportError("libtorch_cpu.so: cannot open shared object file")
            return None

    sys.meta_path.insert(0, _BrokenTorch())
    """
)
ADVICE = ('pip install "subquad[torch]"', 'pip install "subquad[jax]"', "import subquad.jax")
SCRIPT = pathlib.Path(sys.executable).with_name("subquad")  # the console script, beside this Python


def _env(tmp_path: pathlib.Path, sitecustomize: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if sitecustomize is not None:
        (tmp_path / "sitecustomize.py").write_text(sitecustomize)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    return env


def _run(args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)


def _python(code: str, env: Dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", textwrap.dedent(code)], env)


@pytest.fixture
def no_torch(tmp_path: pathlib.Path) -> Dict[str, str]:
    return _env(tmp_path, BLOCK_TORCH)


def test_version_is_the_installed_distributions():
    assert subquad.__version__ == importlib.metadata.version("subquad"), (
        "the installed metadata is stale: reinstall (pip install -e .)"
    )


@pytest.mark.parametrize("torch_installed", [True, False], ids=["with-torch", "without-torch"])
@pytest.mark.parametrize("how", ["python -m subquad", "main(['--version'])", "console script"])
def test_version_needs_no_torch(tmp_path, torch_installed, how):
    env = _env(tmp_path, None if torch_installed else BLOCK_TORCH)
    if how == "console script":
        if not SCRIPT.exists():
            pytest.skip(f"no console script at {SCRIPT}")
        args = [str(SCRIPT), "--version"]
    elif how == "python -m subquad":
        args = [sys.executable, "-m", "subquad", "--version"]
    else:
        args = [sys.executable, "-c", "from subquad._cli import main; main(['--version'])"]
    res = _run(args, env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"subquad {subquad.__version__}", res.stdout + res.stderr


def test_help_lists_version(no_torch):
    res = _run([sys.executable, "-m", "subquad", "--help"], no_torch)
    assert res.returncode == 0 and "--version" in res.stdout, res.stdout + res.stderr


def test_subquad_jax_imports_and_runs_without_torch(no_torch):
    pytest.importorskip("jax")
    res = _python(
        """
        import sys
        import subquad.jax as sj
        assert "torch" not in sys.modules, "subquad.jax imported torch"
        import jax, jax.numpy as jnp, numpy as np
        q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 9, 2, 8)) for i in range(3))
        out = sj.dot_product_attention(q, k, v, is_causal=True)
        ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
        assert "torch" not in sys.modules, "a call imported torch"
        print("ok")
        """,
        no_torch,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("statement", ["import subquad", "from subquad import attention", "from subquad import jax"])
def test_subquad_without_torch_says_what_to_install(no_torch, statement):
    res = _python(
        f"""
        try:
            {statement}
        except ModuleNotFoundError as e:
            print(e.name, "|", e)
        """,
        no_torch,
    )
    assert res.returncode == 0, res.stderr
    name, _, message = res.stdout.strip().partition(" | ")
    assert name == "torch", res.stdout
    for advice in ADVICE:
        assert advice in message, f"{advice!r} missing from {message!r}"


def test_torch_names_after_subquad_jax_say_what_to_install(no_torch):
    """``import subquad.jax`` leaves a package without its torch names: using one says why."""
    pytest.importorskip("jax")
    res = _python(
        """
        import subquad.jax, subquad
        assert subquad.__version__ and not hasattr(subquad, "no_such_name")
        for name in ("attention", "patch_sdpa", "distributed"):
            try:
                getattr(subquad, name)
            except ModuleNotFoundError as e:
                assert e.name == "torch" and 'subquad[torch]' in str(e), (name, e)
            else:
                raise AssertionError(f"subquad.{name} without torch")
        print("ok")
        """,
        no_torch,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("command", [["info"], [], ["bench", "--help"]], ids=["info", "no-command", "bench"])
def test_cli_commands_without_torch_say_what_to_install(no_torch, command):
    res = _run([sys.executable, "-m", "subquad", *command], no_torch)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and all(advice in res.stderr for advice in ADVICE), res.stderr


def test_a_broken_torch_shows_its_own_error(tmp_path):
    """Only a missing torch becomes install advice; a torch that fails to load reports why."""
    res = _python(
        """
        try:
            import subquad
        except ImportError as e:
            print(type(e).__name__, "|", e)
        """,
        _env(tmp_path, BROKEN_TORCH),
    )
    assert res.stdout.strip() == "ImportError | libtorch_cpu.so: cannot open shared object file", (
        res.stdout + res.stderr
    )
