# SPDX-License-Identifier: Apache-2.0
"""CI stages: ``pytest --ci-stage=NAME`` collects only the test files ci_stages.py assigns to
stage NAME (newest, oldest, asan); with GRADCOMP_CI_FULL=1 every stage collects every file, and
without --ci-stage nothing is left out. The run's header names the stage and each file it leaves
out, and a test file that ci_stages.py does not name stops the run."""
import pytest

import ci_stages


def pytest_addoption(parser):
    parser.addoption("--ci-stage", choices=ci_stages.STAGE_NAMES, default=None,
                     help="collect only the test files tests/python/ci_stages.py assigns to this "
                          "CI stage (GRADCOMP_CI_FULL=1: every file)")


def pytest_configure(config):
    if config.getoption("--ci-stage") is None:
        return
    unassigned = ci_stages.unassigned_files()
    if unassigned:
        raise pytest.UsageError("test files in no CI stage (add them to tests/python/"
                                "ci_stages.py): " + ", ".join(unassigned))


def pytest_ignore_collect(collection_path, config):
    stage = config.getoption("--ci-stage")
    if stage is None or ci_stages.full_run():
        return None
    if not ci_stages.is_test_file(collection_path.name) or \
            collection_path.parent.resolve() != ci_stages.HERE:
        return None
    return True if stage not in ci_stages.STAGES[collection_path.name][0] else None


def _summary(stage):
    files = ci_stages.test_files()
    if ci_stages.full_run():
        return f"ci stage {stage}: all {len(files)} test files (GRADCOMP_CI_FULL=1)"
    ins = ci_stages.files_of(stage)
    out = [f for f in files if f not in ins]
    return (f"ci stage {stage}: {len(ins)} of {len(files)} test files (tests/python/ci_stages.py; "
            f"GRADCOMP_CI_FULL=1 runs all); left out here: {', '.join(out) or 'none'}")


def pytest_report_header(config):
    stage = config.getoption("--ci-stage")
    return None if stage is None else _summary(stage)


def pytest_terminal_summary(terminalreporter, config):  # also shown with -q, unlike the header
    stage = config.getoption("--ci-stage")
    if stage is not None:
        terminalreporter.write_line(_summary(stage))
