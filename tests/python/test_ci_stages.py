# SPDX-License-Identifier: Apache-2.0
"""The CI stage assignment (ci_stages.py, docs/DEVELOPMENT.md "Which stage runs what"):

- every test file is in a stage, and the newest-torch stage runs every file;
- the conftest selects exactly what the table says (checked on stub files in a subprocess: no
  test module is imported), stops a run that meets an unassigned file, and GRADCOMP_CI_FULL=1
  selects everything;
- each CI script runs its own stage;
- the asan stage covers the binding: (1) every file that imports gradcomp._C itself or restores
  C++ state from bytes (names load_state_dict, reshard_state or settle_step) is in it, and (2)
  every entry point of gradcomp._C that any test file reaches, by name in the file or in the
  gradcomp and experiments modules it imports (transitively), is reached by a file of the asan
  stage. The entry points are read from the built extension, so a new binding is counted as soon
  as it exists."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ci_stages

ROOT = ci_stages.HERE.parent.parent
PKG = ROOT / "python_bindings" / "gradcomp"
# the packages whose modules a test file's imports are followed into: the library, and the
# experiments (the clone's top-level package, which the tests import too)
PACKAGES = {"gradcomp": PKG, "experiments": ROOT / "experiments"}
STATE_ENTRY_POINTS = {"load_state_dict", "reshard_state", "settle_step"}


# ---- the table ---------------------------------------------------------------------------------
def test_every_test_file_is_in_a_stage():
    assert ci_stages.unassigned_files() == [], \
        "test files in no CI stage: add each to tests/python/ci_stages.py with its stages and why"
    stale = sorted(set(ci_stages.STAGES) - set(ci_stages.test_files()))
    assert stale == [], f"ci_stages.py names files that do not exist: {stale}"
    for name, (stages, why) in ci_stages.STAGES.items():
        assert stages and set(stages) <= set(ci_stages.STAGE_NAMES), name
        assert why.strip(), f"{name}: say why it runs where it runs"


def test_newest_stage_runs_every_file():
    assert ci_stages.files_of(ci_stages.NEWEST) == ci_stages.test_files()


def test_asan_stage_runs_every_file_of_the_oldest():
    """scripts/test.sh leaves the oldest stage out when the sanitizer stage runs, which is on the
    same torch 1.13: that is only sound while asan holds every oldest file."""
    assert set(ci_stages.files_of(ci_stages.OLDEST)) <= set(ci_stages.files_of(ci_stages.ASAN))


def test_full_run_flag(monkeypatch):
    for value, full in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("GRADCOMP_CI_FULL", value)
        assert ci_stages.full_run() is full
    monkeypatch.delenv("GRADCOMP_CI_FULL")
    assert not ci_stages.full_run()


# ---- the conftest selects what the table says ---------------------------------------------------
def _collect(stub_dir, *args, full=False):
    env = {k: v for k, v in os.environ.items() if k not in ("GRADCOMP_CI_FULL", "PYTEST_ADDOPTS")}
    if full:
        env["GRADCOMP_CI_FULL"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], cwd=stub_dir, env=env,
                          capture_output=True, text=True, timeout=120)


def _files_collected(out):
    return sorted({line.split("::")[0] for line in out.splitlines() if "::" in line})


@pytest.fixture
def stub_dir(tmp_path):
    """conftest.py and ci_stages.py beside one stub test per real test file (same names)."""
    for helper in ("conftest.py", "ci_stages.py"):
        (tmp_path / helper).write_text((ci_stages.HERE / helper).read_text())
    for name in ci_stages.test_files():
        (tmp_path / name).write_text("def test_stub():\n    pass\n")
    return tmp_path


def test_conftest_collects_each_stage_as_the_table_says(stub_dir):
    every = ci_stages.test_files()
    for stage in ci_stages.STAGE_NAMES:
        r = _collect(stub_dir, f"--ci-stage={stage}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert _files_collected(r.stdout) == ci_stages.files_of(stage), stage
        full = _collect(stub_dir, f"--ci-stage={stage}", full=True)
        assert full.returncode == 0, full.stdout + full.stderr
        assert _files_collected(full.stdout) == every, f"{stage} with GRADCOMP_CI_FULL=1"
        assert "GRADCOMP_CI_FULL=1" in full.stdout
    r = _collect(stub_dir)  # no stage: everything
    assert _files_collected(r.stdout) == every
    r = _collect(stub_dir, "--ci-stage=asan")
    left_out = [f for f in every if f not in ci_stages.files_of(ci_stages.ASAN)]
    assert left_out and all(f in r.stdout for f in left_out), "the header lists what is left out"


def test_shards_split_a_stage_into_parts_that_run_every_file_once():
    files = ci_stages.files_of(ci_stages.ASAN)
    for n in (1, 2, 3, 5):
        parts = [ci_stages.shard(files, i, n) for i in range(1, n + 1)]
        assert sorted(f for p in parts for f in p) == files, n
    # about equal time: the two halves CI runs differ by less than the longest file
    t = [sum(ci_stages.ASAN_SECONDS.get(f, ci_stages.DEFAULT_SECONDS) for f in
             ci_stages.shard(files, i, 2)) for i in (1, 2)]
    assert abs(t[0] - t[1]) <= max(ci_stages.ASAN_SECONDS.values()), t
    for bad in ((0, 2), (3, 2)):
        with pytest.raises(ValueError):
            ci_stages.shard(files, *bad)
    for bad in ("2", "a/b", "0/2", "3/2"):
        with pytest.raises(ValueError):
            ci_stages.parse_shard(bad)


def test_conftest_collects_each_shard_and_the_shards_make_the_stage(stub_dir):
    got = []
    for i in (1, 2):
        r = _collect(stub_dir, "--ci-stage=asan", f"--ci-shard={i}/2")
        assert r.returncode == 0, r.stdout + r.stderr
        files = _files_collected(r.stdout)
        assert files == ci_stages.shard(ci_stages.files_of(ci_stages.ASAN), i, 2)
        assert f"shard {i} of 2" in r.stdout
        got += files
    assert sorted(got) == ci_stages.files_of(ci_stages.ASAN)
    for args in (("--ci-shard=1/2",), ("--ci-stage=asan", "--ci-shard=3/2")):
        r = _collect(stub_dir, *args)
        assert r.returncode != 0 and "ci-shard" in r.stdout + r.stderr, args


def test_conftest_stops_at_a_file_in_no_stage(stub_dir):
    (stub_dir / "test_new_thing.py").write_text("def test_stub():\n    pass\n")
    r = _collect(stub_dir, "--ci-stage=newest")
    assert r.returncode != 0
    assert "test_new_thing.py" in r.stdout + r.stderr
    assert "in no CI stage" in r.stdout + r.stderr


def test_each_ci_script_runs_its_stage():
    scripts = ROOT / "scripts"
    for script, stage in (("test.sh", "oldest"), ("test-torch2.sh", "newest"),
                          ("sanitize.sh", "asan")):
        assert f"--ci-stage={stage}" in (scripts / script).read_text(), script


# ---- the asan stage covers the binding ----------------------------------------------------------
def _entry_points():
    """The public module-level names of the built extension: functions, classes, enums,
    constants (a class stands for its methods and properties)."""
    from gradcomp import _C
    return {n for n in dir(_C) if not n.startswith("_")}


def _tree(path: Path):
    return ast.parse(path.read_text(), filename=str(path))


def _names(tree):
    """Identifiers used in code (not in import statements, strings or comments)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def _module_file(dotted: str):
    """python_bindings/gradcomp/... for a gradcomp module name, experiments/... for one of the
    experiments, or None."""
    parts = dotted.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = PACKAGES[parts[0]].joinpath(*parts[1:])
    for p in (base / "__init__.py", base.with_suffix(".py")):
        if p.is_file():
            return p
    return None


def _imports(path: Path, tree):
    """The gradcomp and experiments modules and local test helpers that `path` imports or runs
    (python -m gradcomp.x, a helper script by file name): paths."""
    here = path.parent
    # the package a module of gradcomp (or of the experiments) is in, for relative imports:
    # gradcomp/torch/_hook.py and gradcomp/torch/__init__.py are both in gradcomp.torch
    package = next(([top] + list(path.relative_to(folder).parts[:-1])
                    for top, folder in PACKAGES.items() if folder in path.parents), None)
    found = set()

    def add_module(dotted):
        f = _module_file(dotted)
        if f is not None:
            found.add(f)
        elif (here / f"{dotted}.py").is_file():
            found.add(here / f"{dotted}.py")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                for i in range(1, len(parts) + 1):  # import gradcomp.torch imports gradcomp too
                    add_module(".".join(parts[:i]))
        elif isinstance(node, ast.ImportFrom):
            if node.level and package is not None:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                add_module(".".join(parts[:i]))
            for a in node.names:  # from gradcomp import dropcompute: a submodule
                add_module(f"{mod}.{a.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            s = node.value
            if re.fullmatch(r"(gradcomp|experiments)(\.\w+)*", s):
                add_module(s)
            elif s.endswith(".py") and (here / s).is_file() and (here / s) != path:
                found.add(here / s)
    found.discard(path)
    return found


class _Reach:
    def __init__(self, entry_points):
        self.entry_points = entry_points
        self.cache = {}

    def direct(self, path):
        if path not in self.cache:
            tree = _tree(path)
            self.cache[path] = (_names(tree), _imports(path, tree))
        return self.cache[path]

    def reach(self, path):
        """Entry points named by `path` or by any module it imports, transitively."""
        seen, todo, names = set(), [path], set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            n, imports = self.direct(p)
            names |= n & self.entry_points
            todo.extend(imports)
        return names


def _imports_extension_itself(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gradcomp" and \
                any(a.name == "_C" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradcomp._C"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("gradcomp._C")
                                                for a in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "_C" and \
                isinstance(node.value, ast.Name) and node.value.id == "gradcomp":
            return True
    return False


def test_asan_stage_has_every_file_that_imports_the_extension_or_restores_its_state():
    asan = set(ci_stages.files_of(ci_stages.ASAN))
    missing = []
    for name in ci_stages.test_files():
        tree = _tree(ci_stages.HERE / name)
        why = []
        if _imports_extension_itself(tree):
            why.append("imports gradcomp._C")
        state = sorted(_names(tree) & STATE_ENTRY_POINTS)
        if state:
            why.append("restores C++ state (" + ", ".join(state) + ")")
        if why and name not in asan:
            missing.append(f"{name}: {'; '.join(why)}")
    assert missing == [], "not in the asan stage: " + " | ".join(missing)


def test_asan_stage_names_every_entry_point_a_test_names():
    """An entry point a test file calls by name (the binding tests: codecs, plans, analytics,
    checkpoint tools) is called by name in a file of the asan stage too, not only somewhere in
    the package modules its files import."""
    entry = _entry_points()
    r = _Reach(entry)
    asan = set().union(*(r.direct(ci_stages.HERE / f)[0] & entry
                         for f in ci_stages.files_of(ci_stages.ASAN)))
    gaps = {}
    for name in ci_stages.test_files():
        for ep in sorted((r.direct(ci_stages.HERE / name)[0] & entry) - asan):
            gaps.setdefault(ep, []).append(name)
    assert gaps == {}, f"named only by files outside the asan stage: {gaps}"


def test_asan_stage_reaches_every_entry_point_the_suite_reaches():
    entry = _entry_points()
    assert {"make_plan", "TopKCompressor", "reshard_state"} <= entry  # read from the extension
    r = _Reach(entry)
    asan = set().union(*(r.reach(ci_stages.HERE / f)
                         for f in ci_stages.files_of(ci_stages.ASAN)))
    gaps = {}
    for name in ci_stages.test_files():
        if name in ci_stages.files_of(ci_stages.ASAN):
            continue
        for ep in sorted(r.reach(ci_stages.HERE / name) - asan):
            gaps.setdefault(ep, []).append(name)
    assert gaps == {}, ("entry points of gradcomp._C reached only by files outside the asan "
                        f"stage (put one of them in it, or a test of its own): {gaps}")
    # the reach is real: the hooks' plans, the codecs and the checkpoint tools are among it
    assert {"make_plan", "make_shard_plan", "TopKCompressor", "reshard_state"} <= asan


def test_asan_stage_reaches_every_function_of_the_extension():
    """Stricter for functions than for classes: every public function of gradcomp._C is named by
    the asan stage's files or the modules they import. (Classes and enums such as Collective or
    AnalyticPoint are returned by functions and used where they come back, without a name.)"""
    from gradcomp import _C
    entry = _entry_points()
    functions = {n for n in entry
                 if callable(getattr(_C, n)) and not isinstance(getattr(_C, n), type)}
    assert {"make_plan", "settle_step", "reshard_state"} <= functions
    r = _Reach(entry)
    asan = set().union(*(r.reach(ci_stages.HERE / f)
                         for f in ci_stages.files_of(ci_stages.ASAN)))
    assert sorted(functions - asan) == [], \
        "functions of gradcomp._C that no file of the asan stage calls: add a test that does"


def test_reach_follows_imports_into_the_package(tmp_path):
    """The analysis itself: a file reaches what the gradcomp modules it imports name."""
    entry = _entry_points()
    t = tmp_path / "test_probe.py"
    t.write_text("import gradcomp.torch as gt\n")
    reach = _Reach(entry).reach(t)
    assert "make_plan" in reach  # gradcomp.torch -> _families / _hook -> _C.make_plan
    t.write_text("x = 1\n")
    assert _Reach(entry).reach(t) == set()
