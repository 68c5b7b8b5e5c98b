# SPDX-License-Identifier: Apache-2.0
"""The docstrings' examples run (14 examples named functions that did not exist at
that path, and one stated a wrong value). Every ``Example:`` block of the extension's public
classes, methods and functions is executed in order, with a few placeholder inputs the examples
leave to the reader (a gathered latency trace, a gradient, a model); a value the example states
(``# ~2.369``, ``== 306``) is checked. Every ``gradcomp.<path>`` a docstring of the extension or
of the Python modules names must exist."""
import importlib
import inspect
import re
import textwrap

import numpy as np
import pytest

import gradcomp
from gradcomp import _C

# (the experiments, the clone's top-level package, name gradcomp paths too: a stale one, such as
# the gradcomp.experiments they were once part of, fails here)
PY_MODULES = ["gradcomp", "gradcomp.dropcompute", "gradcomp.bench", "gradcomp.scale",
              "experiments.netem", "experiments.fashion_mnist", "experiments.data",
              "experiments.report", "experiments.launch", "experiments.latency"]
TORCH_MODULES = ["gradcomp.torch", "gradcomp.torch._families", "gradcomp.torch.qsr",
                 "gradcomp.torch.onebit_adam",
                 "gradcomp.torch.dropcompute",
                 "experiments.baselines", "experiments.train", "experiments.models"]


def _docs():
    """(owner name, docstring) of every public object of the extension and its methods."""
    for name in sorted(n for n in dir(_C) if not n.startswith("_")):
        obj = getattr(_C, name)
        yield name, obj.__doc__ or ""
        if isinstance(obj, type):
            for attr in sorted(vars(obj)):
                if attr.startswith("_") and attr != "__init__":
                    continue
                yield f"{name}.{attr}", getattr(getattr(obj, attr), "__doc__", None) or ""


def _examples():
    out = []
    for owner, doc in _docs():
        for m in re.finditer(r"Example:[ \t]*(.*?)(?:\n\s*\n|\Z)", doc, re.S):
            first, _, rest = m.group(1).partition("\n")
            code = (first.strip() + "\n" + textwrap.dedent(rest)).strip()
            out.append((owner, code))
    return out


EXAMPLES = _examples()


class _Grad(np.ndarray):
    """A float32 vector with numel(), as a torch tensor has."""

    def numel(self):
        return self.size


def _namespace():
    gathered = np.random.default_rng(0).lognormal(0.0, 0.2, 4 * 5 * 12)
    grad = np.linspace(-1, 1, 1000, dtype=np.float32).view(_Grad)
    return {
        "gradcomp": gradcomp, "np": np, "gathered": gathered,
        "trace": gradcomp.dropcompute.LatencyTrace(4, 5, 12, gathered),
        "model": gradcomp.dropcompute.AnalyticModel(workers=64, micro_batches=12, mu=1.0, sigma=0.3,
                                        serial_time=0.5),
        "grad": grad, "out": np.zeros(grad.size, dtype=np.float32),
        "T": 1000, "lr0": 0.1, "s": 0, "next_lr": 0.1, "average": lambda: None,
        "forward_backward": lambda: None,
    }


def test_examples_were_found():
    assert len(EXAMPLES) >= 14, EXAMPLES


@pytest.mark.parametrize("owner,code", EXAMPLES, ids=[o for o, _ in EXAMPLES])
def test_docstring_example_runs(owner, code):
    ns = _namespace()
    lines = code.splitlines()
    last = lines[-1]
    approx = re.search(r"#\s*~\s*([0-9.eE+-]+)", last)
    body = "\n".join(lines[:-1] + [last.split("#")[0].rstrip()])
    if approx or re.search(r"==", last.split("#")[0]):
        # a one-line expression with a stated value
        assert len(lines) == 1, code
        value = eval(body, ns)  # noqa: S307 - our own docstrings
        if approx:
            assert value == pytest.approx(float(approx.group(1)), rel=0.02), (owner, value)
        else:
            assert value is True, (owner, code)
    else:
        exec(compile(body, f"<{owner} example>", "exec"), ns)  # noqa: S102


def _refs(text):
    return set(re.findall(r"\bgradcomp\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)",
                          text))


def _resolves(path):
    obj = gradcomp
    parts = path.split(".")
    for i, p in enumerate(parts):
        if hasattr(obj, p):
            obj = getattr(obj, p)
            continue
        try:
            obj = importlib.import_module("gradcomp." + ".".join(parts[:i + 1]))
        except ImportError:
            return False
    return True


def _check_refs(texts):
    bad = sorted({r for t in texts for r in _refs(t) if not _resolves(r)})
    assert not bad, f"docstrings name gradcomp paths that do not exist: {bad}"


def test_every_named_gradcomp_path_exists():
    _check_refs([doc for _, doc in _docs()]
                + [inspect.getsource(importlib.import_module(m)) for m in PY_MODULES])


def test_every_named_gradcomp_path_exists_in_the_torch_modules():
    pytest.importorskip("torch")
    _check_refs([inspect.getsource(importlib.import_module(m)) for m in TORCH_MODULES])
