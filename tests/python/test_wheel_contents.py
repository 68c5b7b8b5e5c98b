# SPDX-License-Identifier: Apache-2.0
"""The wheel ships the library, not the experiments. pyproject.toml packs python_bindings/gradcomp
alone; that package holds no experiments and imports none; the gradcomp under test (the installed
wheel, or the source tree the sanitizer and GPU stages stage) has no gradcomp.experiments. The
experiments are the clone's top-level package ``experiments``, run from its root as
``python -m experiments.<name>`` (conftest.py puts that root on sys.path for the tests)."""
import ast
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

import gradcomp

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python_bindings" / "gradcomp"
EXPERIMENTS = ROOT / "experiments"


def test_pyproject_packs_the_library_alone():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = cfg["tool"]["scikit-build"]["wheel"]
    assert wheel["packages"] == ["python_bindings/gradcomp"]
    # no extra package, force-include or install directory that brings the experiments back
    assert "experiments" not in json.dumps(wheel), wheel


def test_the_package_source_holds_no_experiments():
    files = [p.relative_to(PKG) for p in PKG.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    assert any(p.name == "__init__.py" for p in files)  # (the walk found the package)
    inside = [str(p) for p in files if "experiments" in p.parts or p.suffix == ".sh"]
    assert inside == [], f"experiment files inside the wheel's package: {inside}"
    # where they are instead: the clone's top-level package, netns.sh beside netem.py (which
    # runs it by a path computed from its own file)
    for name in ("__init__.py", "fashion_mnist.py", "train.py", "launch.py", "netem.py",
                 "netns.sh"):
        assert (EXPERIMENTS / name).is_file(), name


def _experiment_imports(path: Path):
    """Imports of the experiments in a module of the library: import / from statements (absolute
    or relative), and strings naming one (importlib.import_module, python -m)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if re.fullmatch(r"[\w.]+", node.value) else []
        found += [n for n in names if re.match(r"(gradcomp\.)?experiments(\.|$)", n.lstrip("."))]
        if isinstance(node, ast.ImportFrom) and node.level and any(
                a.name == "experiments" for a in node.names):
            found.append(f"from {'.' * node.level}{node.module or ''} import experiments")
    return found


def test_the_library_imports_no_experiments():
    bad = {str(p.relative_to(ROOT)): imports for p in sorted(PKG.rglob("*.py"))
           for imports in [_experiment_imports(p)] if imports}
    assert bad == {}, f"library modules importing the experiments: {bad}"


def test_the_check_sees_an_import_of_the_experiments(tmp_path):
    probe = tmp_path / "probe.py"
    for src in ("from experiments import launch\n", "import gradcomp.experiments.train\n",
                "from .experiments.netem import SCRIPT\n", "from . import experiments\n",
                "importlib.import_module('experiments.latency')\n"):
        probe.write_text(src)
        assert _experiment_imports(probe), src
    probe.write_text("# see experiments/auto_sweep.py\nhelp = 'experiments/ddp_hooks_bench.py'\n")
    assert _experiment_imports(probe) == []


def test_the_gradcomp_under_test_has_no_experiments():
    assert importlib.util.find_spec("gradcomp.experiments") is None, \
        f"gradcomp.experiments is importable from {os.path.dirname(gradcomp.__file__)}"
    assert "experiments" not in os.listdir(os.path.dirname(gradcomp.__file__))
    # the experiments the tests import are the clone's
    spec = importlib.util.find_spec("experiments")
    assert spec is not None and Path(spec.origin).resolve() == EXPERIMENTS / "__init__.py"
