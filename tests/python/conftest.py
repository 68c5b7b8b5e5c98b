# SPDX-License-Identifier: Apache-2.0
"""CI stages: ``pytest --ci-stage=NAME`` collects only the test files ci_stages.py assigns to
stage NAME (newest, oldest, asan); with GRADCOMP_CI_FULL=1 every stage collects every file, and
without --ci-stage nothing is left out. ``--ci-shard=I/N`` narrows that to shard I of N
(ci_stages.shard), so that N processes can share a stage. The run's header names the stage and each file it leaves
out, and a test file that ci_stages.py does not name stops the run.

The experiments are not in the wheel, which ships the library: they are the clone's top-level
package ``experiments``, which the tests import (ddp_util's rank launcher comes from it too) while
gradcomp is the installed one, so the clone's root goes on sys.path here (the ranks forked from
multiprocessing's server are handed this sys.path)."""
import sys

import pytest

import ci_stages

ROOT = ci_stages.HERE.parent.parent
if (ROOT / "experiments" / "__init__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser):
    parser.addoption("--ci-stage", choices=ci_stages.STAGE_NAMES, default=None,
                     help="collect only the test files tests/python/ci_stages.py assigns to this "
                          "CI stage (GRADCOMP_CI_FULL=1: every file)")
    parser.addoption("--ci-shard", default=None, metavar="I/N",
                     help="with --ci-stage: only shard I of N of the stage's files (about equal "
                          "time each, ci_stages.shard); the N shards together run every file")


def _shard(config):
    text = config.getoption("--ci-shard")
    return None if text is None else ci_stages.parse_shard(text)


def _files(config, stage):
    """The files this run collects: the stage's (every file with GRADCOMP_CI_FULL=1), or its
    shard's."""
    files = ci_stages.test_files() if ci_stages.full_run() else ci_stages.files_of(stage)
    sh = _shard(config)
    return files if sh is None else ci_stages.shard(files, *sh)


def pytest_configure(config):
    if config.getoption("--ci-stage") is None:
        if config.getoption("--ci-shard") is not None:
            raise pytest.UsageError("--ci-shard needs --ci-stage")
        return
    try:
        _shard(config)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    unassigned = ci_stages.unassigned_files()
    if unassigned:
        raise pytest.UsageError("test files in no CI stage (add them to tests/python/"
                                "ci_stages.py): " + ", ".join(unassigned))


def pytest_ignore_collect(collection_path, config):
    stage = config.getoption("--ci-stage")
    if stage is None:
        return None
    if not ci_stages.is_test_file(collection_path.name) or \
            collection_path.parent.resolve() != ci_stages.HERE:
        return None
    return True if collection_path.name not in _files(config, stage) else None


def _summary(config, stage):
    files = ci_stages.test_files()
    sh = _shard(config)
    part = "" if sh is None else f", shard {sh[0]} of {sh[1]}"
    ins = _files(config, stage)
    if ci_stages.full_run() and sh is None:
        return f"ci stage {stage}: all {len(files)} test files (GRADCOMP_CI_FULL=1)"
    out = [f for f in files if f not in ins]
    return (f"ci stage {stage}{part}: {len(ins)} of {len(files)} test files "
            f"(tests/python/ci_stages.py; GRADCOMP_CI_FULL=1 runs all); left out here: "
            f"{', '.join(out) or 'none'}")


def pytest_report_header(config):
    stage = config.getoption("--ci-stage")
    return None if stage is None else _summary(config, stage)


def pytest_terminal_summary(terminalreporter, config):  # also shown with -q, unlike the header
    stage = config.getoption("--ci-stage")
    if stage is not None:
        terminalreporter.write_line(_summary(config, stage))
