# SPDX-License-Identifier: Apache-2.0
"""The include graph points downwards only (docs/ARCHITECTURE.md, "Layers"): each public header
includes only headers below it in the order the architecture document lists, the kernels'
entry-point headers include no codec, plan or engine header, and no codec or kernel includes the
communicator. Read from the sources; nothing is built."""
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# bottom up, as docs/ARCHITECTURE.md lists them
PUBLIC = ["error", "types", "tensor", "runtime", "workspace", "wire", "rng", "select", "orthogonalization", "compressor", "topk", "onebit", "quant", "powersgd", "plan",
          "cost_model", "plan_config", "make_plan", "comm", "straggler", "gradcomp"]
# what the kernels may see of the public API: value types, no codec, plan or engine
KERNEL_OK = {"error", "types", "tensor", "runtime", "workspace", "rng", "select",
             "orthogonalization", "detail/macros", "detail/numeric"}
# include/gradcomp/detail/: what kernels and codecs share (host-device macros, fp16/bf16 rounding),
# below every public header and including none of them but error.hpp and tensor.hpp
DETAIL = {"detail/macros": [], "detail/numeric": ["detail/macros", "tensor"]}


def _includes(path):
    with open(path) as f:
        return re.findall(r'#include "gradcomp/([a-z_/]+)\.hpp"', f.read())


def _files(folder, exts):
    base = os.path.join(ROOT, folder)
    for dirpath, _, names in os.walk(base):
        for n in names:
            if n.endswith(exts):
                yield os.path.join(dirpath, n)


def test_public_headers_include_only_headers_below_them():
    folder = os.path.join(ROOT, "include", "gradcomp")
    names = sorted(n[:-4] for n in os.listdir(folder) if n.endswith(".hpp"))
    assert sorted(PUBLIC) == names, "a public header was added or removed: place it in PUBLIC"
    rank = {h: i for i, h in enumerate(PUBLIC)}
    rank.update({d: -1 for d in DETAIL})
    upward = [(h, inc) for h in PUBLIC for inc in _includes(os.path.join(folder, h + ".hpp"))
              if rank[inc] >= rank[h]]
    assert not upward, f"headers including one above them: {upward}"
    for d, allowed in DETAIL.items():
        got = set(_includes(os.path.join(folder, d + ".hpp")))
        assert got <= set(allowed), f"{d}.hpp includes {sorted(got - set(allowed))}"


def test_kernels_and_codecs_do_not_reach_up():
    bad = []
    for path in _files("kernels", (".hpp", ".h", ".cpp", ".cu", ".cuh")):
        bad += [(path, inc) for inc in _includes(path) if inc not in KERNEL_OK]
    for path in _files("compressors", (".hpp", ".cpp")):
        bad += [(path, inc) for inc in _includes(path) if inc in ("comm", "make_plan", "plan_config")]
    # the plan classes' private headers sit above the codecs and kernels too
    for folder in ("kernels", "compressors"):
        for path in _files(folder, (".hpp", ".h", ".cpp", ".cu", ".cuh")):
            with open(path) as f:
                bad += [(path, q) for q in re.findall(r'#include "(plans/[^"]+)"', f.read())]
    assert not bad, f"kernels or codecs including headers above their layer: {bad}"


def test_python_reads_the_collective_vocabulary_of_the_one_cpp_table():
    """The torch driver switches on a collective's kind and type names: those are the names of
    gradcomp/types.hpp's tables, every one of them handled."""
    pytest.importorskip("torch")
    import inspect

    from gradcomp import _C
    from gradcomp.torch import _driver

    assert sorted(_driver._TORCH_TYPES) == sorted(_C.elem_type_names())
    src = inspect.getsource(_driver.launch)
    for kind in _C.collective_names():
        assert f'kind == "{kind}"' in src, f"launch() does not handle {kind!r}"


def test_public_headers_include_no_private_header():
    """The plan classes are private to plans/ (users build plans by name with make_plan and drive
    them as BucketPlan): an installed header that included one would not compile for a user."""
    bad = []
    for path in _files(os.path.join("include", "gradcomp"), (".hpp",)):
        with open(path) as f:
            quoted = re.findall(r'#include "([^"]+)"', f.read())
        bad += [(os.path.relpath(path, ROOT), q) for q in quoted if not q.startswith("gradcomp/")]
    assert not bad, f"public headers including private ones: {bad}"
