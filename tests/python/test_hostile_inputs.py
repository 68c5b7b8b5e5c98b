# SPDX-License-Identifier: Apache-2.0
"""Hostile inputs at the Python API: wrong dtypes, strided / reversed / transposed
arrays, wrong sizes, NaN/Inf, read-only arrays, arrays that are not arrays, misaligned data,
wrong payload kinds and tensor ids, truncated payloads and states, for every codec and plan.

Each must raise a clean exception (ValueError, TypeError or RuntimeError), leave the state as it
was (state_dict() bytes compared) and never write a wrong output silently. No array argument is
ever copied or converted: an array the binding writes into must be C-contiguous and writable, an
array it only reads must be C-contiguous. The crashing cases (a plan that reads or writes an array
after the caller's last reference to it is gone) run in a subprocess, so a crash fails the test
instead of killing pytest."""
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import gradcomp
from gradcomp import _C
from gradcomp.bench import run_local  # drives a world-size-1 plan

try:
    import torch
except ImportError:  # the NumPy cases still run
    torch = None

ROWS, COLS = 8, 8  # every gradient is an 8 x 8 array: transposed and strided views keep the shape
N = ROWS * COLS
ERRORS = (ValueError, TypeError, RuntimeError)
CODECS = ["topk", "randomk", "onebit"]


def make_codec(name, tensor_id=0, numel=N):
    if name == "topk":
        return _C.TopKCompressor(numel, ratio=0.25, method="exact", tensor_id=tensor_id)
    if name == "randomk":
        return _C.RandomKCompressor(numel, ratio=0.25, tensor_id=tensor_id)
    return _C.OneBitCompressor(numel // COLS, COLS, scaling="sign_l1", tensor_id=tensor_id)


def good_grad(seed=0, numel=N):
    return np.random.default_rng(seed).standard_normal((numel // COLS, COLS)).astype(np.float32)


def used_codec(name, **kw):
    """A codec that has encoded one gradient (non-trivial residual and step)."""
    c = make_codec(name, **kw)
    c.encode(good_grad(1, kw.get("numel", N)), gradcomp.Payload())
    return c


def payload_of(name, **kw):
    c = make_codec(name, **kw)
    p = gradcomp.Payload()
    c.encode(good_grad(2, kw.get("numel", N)), p)
    return p.array().copy()


def read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def misaligned(shape=(ROWS, COLS)):
    """A writable float32 array whose data pointer is one byte past an aligned address."""
    n = int(np.prod(shape))
    buf = np.zeros(4 * n + 1, np.uint8)
    return buf[1:].view(np.float32).reshape(shape)


# Views that are not C-contiguous but have the right shape (8 x 8): every binding must refuse
# them (a copy would be written instead of the caller's memory, or freed while a plan uses it).
def _np_strided():
    return np.zeros((ROWS, 2 * COLS), np.float32)[:, ::2]


def _np_reversed():
    return np.zeros((ROWS, COLS), np.float32)[::-1]


def _np_transposed():
    return np.zeros((COLS, ROWS), np.float32).T


NONCONTIG = {"np-strided": _np_strided, "np-reversed": _np_reversed,
             "np-transposed": _np_transposed}
if torch is not None:
    NONCONTIG["torch-transposed"] = lambda: torch.zeros(COLS, ROWS).t()
    NONCONTIG["torch-strided"] = lambda: torch.zeros(ROWS, 2 * COLS)[:, ::2]


def _nan_at(i, v=np.nan):
    def f():
        g = good_grad()
        g.flat[i] = v
        return g
    return f


# Gradients (read-only inputs of encode) that must be refused.
BAD_GRADS = dict(NONCONTIG)
BAD_GRADS.update({
    "float64": lambda: good_grad().astype(np.float64),
    "int32": lambda: good_grad().astype(np.int32),
    "int64": lambda: good_grad().astype(np.int64),
    "bool": lambda: good_grad() > 0,
    "complex64": lambda: good_grad().astype(np.complex64),
    "big-endian": lambda: good_grad().astype(">f4"),
    "size-0": lambda: np.zeros((0, COLS), np.float32),
    "size-1": lambda: np.ones((1, 1), np.float32),
    "one-row-short": lambda: np.ones((ROWS - 1, COLS), np.float32),
    "one-row-long": lambda: np.ones((ROWS + 1, COLS), np.float32),
    "nan-first": _nan_at(0),
    "nan-last": _nan_at(N - 1),
    "inf": _nan_at(5, np.inf),
    "-inf": _nan_at(6, -np.inf),
    "misaligned": misaligned,
    "list": lambda: good_grad().tolist(),
    "none": lambda: None,
    "string": lambda: "gradient",
})
if torch is not None:
    BAD_GRADS.update({
        "torch-float64": lambda: torch.from_numpy(good_grad()).double(),
        "torch-int64": lambda: torch.from_numpy(good_grad()).long(),
        "torch-nan": lambda: torch.from_numpy(_nan_at(3)()),
    })

# Outputs (decode_add's dense, written in place) that must be refused.
BAD_OUTPUTS = dict(NONCONTIG)
BAD_OUTPUTS.update({
    "read-only": lambda: read_only(np.zeros((ROWS, COLS), np.float32)),
    "float64": lambda: np.zeros((ROWS, COLS), np.float64),
    "float16": lambda: np.zeros((ROWS, COLS), np.float16),
    "int32": lambda: np.zeros((ROWS, COLS), np.int32),
    "size-0": lambda: np.zeros(0, np.float32),
    "one-short": lambda: np.zeros(N - 1, np.float32),
    "misaligned": misaligned,
    "list": lambda: [0.0] * N,
})


def _unchanged(out):
    """A copy of the values an array held before a refused call, to compare with afterwards."""
    return list(out) if isinstance(out, list) else np.array(np.asarray(out), copy=True)


def _same_values(a, b):
    if isinstance(a, list):
        return a == b
    a = np.asarray(a)
    return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


# ---- codecs: encode ----------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("case", sorted(BAD_GRADS))
def test_encode_refuses_bad_gradient_and_keeps_state(codec, case):
    c = used_codec(codec)
    before, step = c.state_dict(), c.step
    with pytest.raises(ERRORS):
        c.encode(BAD_GRADS[case](), gradcomp.Payload())
    assert c.state_dict() == before and c.step == step


@pytest.mark.parametrize("codec", CODECS)
def test_encode_accepts_read_only_gradient(codec):
    """encode() only reads its input: a read-only array is fine and gives the same payload."""
    ref, p_ref = make_codec(codec), gradcomp.Payload()
    ref.encode(good_grad(), p_ref)
    c, p = make_codec(codec), gradcomp.Payload()
    c.encode(read_only(good_grad()), p)
    assert bytes(p.array()) == bytes(p_ref.array())
    assert c.state_dict() == ref.state_dict()


# ---- codecs: decode_add ------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_decode_add_refuses_bad_output_and_writes_nothing(codec, case):
    c = used_codec(codec)
    before = c.state_dict()
    out = BAD_OUTPUTS[case]()
    vals = _unchanged(out)
    with pytest.raises(ERRORS):
        c.decode_add(payload_of(codec), out)
    assert _same_values(out, vals)
    assert c.state_dict() == before


def _truncations(p):
    return {"minus-1": p[:-1], "minus-8": p[:-8], "header-only": p[:64], "header-minus-1": p[:63],
            "one-byte": p[:1], "empty": p[:0]}


def _bad_payloads(codec):
    p = payload_of(codec)
    cases = {f"truncated-{k}": v for k, v in _truncations(p).items()}
    for other in CODECS:
        if other != codec:
            cases[f"kind-{other}"] = payload_of(other)
    cases["other-numel"] = payload_of(codec, numel=2 * N)
    flipped = p.copy()
    flipped[0] ^= 0xFF  # magic
    cases["bad-magic"] = flipped
    cases["int64-view"] = p[: len(p) // 8 * 8].view(np.int64)
    cases["int8-view"] = p.view(np.int8)
    cases["strided"] = np.repeat(p, 2)[::2]
    cases["2-d"] = p[: len(p) // 8 * 8].reshape(-1, 8)
    cases["misaligned"] = np.concatenate([np.zeros(1, np.uint8), p])[1:]
    cases["list"] = p.tolist()
    cases["none"] = None
    return cases


PAYLOAD_CASES = sorted(_bad_payloads("topk"))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("case", PAYLOAD_CASES + ["kind-self"])
def test_decode_add_refuses_bad_payload_and_writes_nothing(codec, case):
    cases = _bad_payloads(codec)
    if case not in cases:
        pytest.skip("a payload of its own kind is no wrong kind")
    c = used_codec(codec)
    before = c.state_dict()
    out = np.zeros((ROWS, COLS), np.float32)
    with pytest.raises(ERRORS):
        c.decode_add(cases[case], out)
    assert not out.any()
    assert c.state_dict() == before


@pytest.mark.parametrize("codec", ["topk", "randomk", "onebit"])
def test_decode_add_refuses_other_tensor_id(codec):
    c = used_codec(codec, tensor_id=2)
    out = np.zeros((ROWS, COLS), np.float32)
    with pytest.raises(ERRORS):
        c.decode_add(payload_of(codec, tensor_id=1), out)
    assert not out.any()


@pytest.mark.parametrize("codec", CODECS)
def test_decode_add_into_offset_views_is_exact(codec):
    """Contiguous views that do not start their buffer (a storage offset) are written in place."""
    p = payload_of(codec)
    ref = np.zeros((ROWS, COLS), np.float32)
    make_codec(codec).decode_add(p, ref)
    assert ref.any()
    big = np.zeros(3 * N, np.float32)
    make_codec(codec).decode_add(p, big[N:2 * N].reshape(ROWS, COLS))
    np.testing.assert_array_equal(big[N:2 * N].reshape(ROWS, COLS), ref)
    assert not big[:N].any() and not big[2 * N:].any()
    if torch is not None:
        t = torch.zeros(3 * N)
        make_codec(codec).decode_add(torch.from_numpy(p), t[N:2 * N].view(ROWS, COLS))
        np.testing.assert_array_equal(t[N:2 * N].view(ROWS, COLS).numpy(), ref)
        assert not t[:N].any() and not t[2 * N:].any()


# ---- codecs: load_state_dict -------------------------------------------------------------------
def _bad_states(codec):
    s = used_codec(codec).state_dict()
    cases = {"truncated-minus-1": s[:-1], "truncated-half": s[: len(s) // 2], "empty": b"",
             "other-numel": used_codec(codec, numel=2 * N).state_dict()}
    for other in CODECS:
        if other != codec:
            cases[f"kind-{other}"] = used_codec(other).state_dict()
    return cases


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("case", ["truncated-minus-1", "truncated-half", "empty", "other-numel",
                                  "kind-topk", "kind-randomk", "kind-onebit"])
def test_load_state_dict_refuses_bad_state_and_keeps_state(codec, case):
    cases = _bad_states(codec)
    if case not in cases:
        pytest.skip("a state of its own kind is no wrong kind")
    c = used_codec(codec)
    c.encode(good_grad(3), gradcomp.Payload())
    before, step = c.state_dict(), c.step
    with pytest.raises(ERRORS):
        c.load_state_dict(cases[case])
    assert c.state_dict() == before and c.step == step


# ---- plans -------------------------------------------------------------------------------------
def onebit_plan(world=1, n=None, **kw):
    """The 1-bit plan in the paper's form (one scale per server chunk, L1 scale, no rotation),
    unless kw says otherwise."""
    o = dict(scaling="sign_l1", block_size=0, rotate=False)
    o.update(kw)
    return _C.make_plan("onebit", N if n is None else n, "float32", world, options=o)


def make_plan(name, world=1):
    """(plan, begin(grad) -> None, state_dict() or None)."""
    if name == "dense":
        p = _C.make_plan("allreduce", N, "float32", world)
    elif name == "cast":
        p = _C.make_plan("fp16", N, "float32", world, options=dict(route="allreduce"))
    elif name == "topk":
        p = _C.make_plan("topk", N, "float32", world,
                         options=dict(ratio=0.25, method="exact"))
    elif name == "randomk":
        p = _C.make_plan("randomk", N, "float32", world, options=dict(ratio=0.25))
    elif name == "onebit":
        p = onebit_plan(world)
        return p, p.begin, p.state_dict  # in place, as the hook runs it
    else:
        st = _C.PowerSGDState([[ROWS, COLS]], rank=2, min_compression_rate=0.0)
        p = _C.PowerSGDPlan(st, world)
        return p, (lambda g: p.begin([g])), st.state_dict
    return p, p.begin, getattr(p, "state_dict", None)


PLANS = ["dense", "cast", "topk", "randomk", "onebit", "powersgd"]
CHECKED_FINITE = {"topk", "randomk", "onebit", "powersgd"}


# A plan writes the average back into its gradient: read-only gradients are refused too. The
# non-contiguous views are tried in a subprocess (test_plan_memory_safety_in_subprocess): a plan
# that took a copy of one would write into freed memory.
BAD_PLAN_GRADS = {k: v for k, v in BAD_GRADS.items() if k not in NONCONTIG}
BAD_PLAN_GRADS["read-only"] = lambda: read_only(good_grad())


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("case", sorted(BAD_PLAN_GRADS))
def test_plan_refuses_bad_gradient_and_keeps_state(name, case):
    if case.startswith(("nan", "inf", "-inf", "torch-nan")) and name not in CHECKED_FINITE:
        pytest.skip("plain and cast allreduce do not check values")
    plan, begin, state_dict = make_plan(name)
    begin(good_grad())
    run_local(plan)
    before = state_dict() if state_dict else None
    g = BAD_PLAN_GRADS[case]()
    vals = _unchanged(g) if case not in ("none", "string") else None
    nonfinite = case.startswith(("nan", "inf", "-inf", "torch-nan"))
    if nonfinite:
        # the default skips the step (no error, the average NaN, the state as it was); with
        # on_nonfinite="raise" the step raises (on every rank), state as it was
        assert plan.on_nonfinite == "skip"
        begin(g)
        run_local(plan)
        assert plan.skipped and np.isnan(np.asarray(g, dtype=np.float64)).all()
        assert state_dict() == before
        plan.on_nonfinite = getattr(_C.OnNonFinite, "raise")  # (a keyword: no attribute syntax)
        g = BAD_PLAN_GRADS[case]()
    with pytest.raises(ERRORS):
        begin(g)
        run_local(plan)  # some plans find a NaN in their first local phase
    if state_dict:
        assert state_dict() == before
    if vals is not None and not nonfinite:  # (a non-finite step's average is NaN)
        assert _same_values(g, vals), "a refused gradient was written"
    # the plan is still usable
    g = good_grad(4)
    begin(g)
    run_local(plan)


@pytest.mark.parametrize("case", sorted(set(BAD_OUTPUTS) - set(NONCONTIG)))
def test_onebit_plan_refuses_bad_output(case):
    plan = onebit_plan(1)
    before = plan.state_dict()
    out = BAD_OUTPUTS[case]()
    vals = _unchanged(out)
    with pytest.raises(ERRORS):
        plan.begin(good_grad(), out=out)
        run_local(plan)
    assert _same_values(out, vals)
    assert plan.state_dict() == before


def test_onebit_plan_reads_a_read_only_gradient():
    assert np.array_equal(_world1_result("onebit", read_only(good_grad())),
                          _world1_result("onebit", good_grad()))


@pytest.mark.parametrize("codec", CODECS)
def test_decode_add_takes_payload_bytes(codec):
    """A payload is only read: bytes (read-only, buffer protocol) decode like the array."""
    p = payload_of(codec)
    a, b = np.zeros((ROWS, COLS), np.float32), np.zeros((ROWS, COLS), np.float32)
    make_codec(codec).decode_add(p, a)
    make_codec(codec).decode_add(bytes(p), b)
    assert a.any() and np.array_equal(a, b)


def test_onebit_plan_refuses_output_aliasing_gradient():
    plan = onebit_plan(1)
    g = good_grad()
    with pytest.raises(ERRORS):
        plan.begin(g, out=g)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_onebit_plan_in_place_equals_separate_output(dtype, rotate):
    """begin(grad) without out writes the average over grad (in grad's dtype): the separate-
    output result, rounded once; a read-only gradient is refused in place and nothing changes.
    With rotate the in-place fp32 form rotates the gradient itself, the others a copy."""
    world = 1
    kw = dict(rotate=True, block_size=32) if rotate else {}
    a, b = onebit_plan(world, **kw), onebit_plan(world, **kw)
    assert a.rotate is rotate
    for step in range(3):
        g = (good_grad() * (step + 1)).astype(dtype)
        out = np.zeros((ROWS, COLS), np.float32)
        a.begin(g.copy(), out=out)
        run_local(a)
        inplace = g.copy()
        b.begin(inplace)
        run_local(b)
        assert np.array_equal(inplace, out.astype(dtype)), step
        assert a.state_dict() == b.state_dict()
    ro = good_grad()
    ro.setflags(write=False)
    before = b.state_dict()
    with pytest.raises(ERRORS):
        b.begin(ro)
    assert b.state_dict() == before


@pytest.mark.parametrize("case", ["too-few", "too-many", "wrong-shape", "not-list"])
def test_powersgd_plan_refuses_bad_gradient_list(case):
    st = _C.PowerSGDState([[ROWS, COLS], [4]], rank=2, min_compression_rate=0.0)
    plan = _C.PowerSGDPlan(st, 1)
    plan.begin([good_grad(), np.ones(4, np.float32)])
    run_local(plan)
    before = st.state_dict()
    a, b = good_grad(), np.ones(4, np.float32)
    grads = {"too-few": [a], "too-many": [a, b, b], "wrong-shape": [a.reshape(COLS * 2, -1), b],
             "not-list": a}[case]
    with pytest.raises(ERRORS):
        plan.begin(grads)
        run_local(plan)
    assert st.state_dict() == before


def test_powersgd_plan_checkpoints_its_state():
    """The plan's state_dict is its state's; restoring through the plan is refused mid-step and
    changes nothing, and the plan keeps the state alive after the caller drops it."""
    st = _C.PowerSGDState([[ROWS, COLS]], rank=2, min_compression_rate=0.0)
    plan = _C.PowerSGDPlan(st, 1)
    plan.begin([good_grad()])
    run_local(plan)
    saved = plan.state_dict()
    assert saved == st.state_dict() and plan.state is st
    del st
    gc.collect()
    assert plan.state.state_dict() == saved  # held by the plan (keep_alive)
    plan.begin([good_grad(1)])
    plan.next()  # mid-step
    with pytest.raises(ERRORS):
        plan.load_state_dict(saved)
    run_local(plan)
    after = plan.state_dict()
    assert after != saved
    plan.load_state_dict(saved)
    assert plan.state_dict() == saved


def _world1_result(name, g):
    plan, begin, _ = make_plan(name)
    if name == "onebit":
        out = np.zeros((ROWS, COLS), np.float32)
        plan.begin(g, out=out)
        run_local(plan)
        return out
    begin(g)
    run_local(plan)
    return g


@pytest.mark.parametrize("name", PLANS)
def test_plan_keeps_its_arrays_alive_until_the_step_ends(name):
    """The caller's last reference may go right after begin(): the plan holds the arrays it
    reads and writes until next() returns None, and lets go of them then."""
    plan, _, _ = make_plan(name)
    g = good_grad()
    ref = weakref.ref(g)
    if name == "onebit":
        out = np.zeros((ROWS, COLS), np.float32)
        ref_out = weakref.ref(out)
        plan.begin(g, out=out)
        del out
    elif name == "powersgd":
        plan.begin([g])
    else:
        plan.begin(g)
    del g
    gc.collect()
    assert ref() is not None, "the plan does not hold its gradient during the step"
    if name == "onebit":
        assert ref_out() is not None, "the plan does not hold its output during the step"
    run_local(plan)
    gc.collect()
    assert ref() is None, "the plan still holds the gradient after the step"


# ---- crashes: in a subprocess ------------------------------------------------------------------
_PRELUDE = """
import numpy as np
from gradcomp import _C
from test_hostile_inputs import onebit_plan, run_local
"""

CRASH_CASES = {
    # every plan, every non-contiguous view of the gradient (and of the 1-bit plan's output):
    # refused, nothing written, the plan still works
    "noncontiguous-every-plan": """
        import test_hostile_inputs as t
        for name in t.PLANS:
            for case, make in sorted(t.NONCONTIG.items()):
                plan, begin, _ = t.make_plan(name)
                g = make()
                try:
                    begin(g)
                    t.run_local(plan)
                except ValueError as e:
                    assert "contiguous" in str(e), (name, case, e)
                else:
                    raise AssertionError(f"{name} took a {case} gradient")
                assert not np.asarray(g).any(), (name, case, "written")
                begin(t.good_grad())
                t.run_local(plan)
        for case, make in sorted(t.NONCONTIG.items()):
            plan = onebit_plan(1, n=t.N)
            out = make()
            try:
                plan.begin(t.good_grad(), out=out)
                t.run_local(plan)
            except ValueError as e:
                assert "contiguous" in str(e), (case, e)
            else:
                raise AssertionError(f"onebit plan took a {case} output")
            assert not np.asarray(out).any(), (case, "written")
        st = _C.PowerSGDState([[t.ROWS, t.COLS]], rank=2)
        try:
            _C.PowerSGDPlan(st, 1).begin([np.ascontiguousarray(t.good_grad()).T])
        except ValueError as e:
            assert "contiguous" in str(e), e
        else:
            raise AssertionError("PowerSGDPlan took a transposed gradient")
        print("OK")
    """,
    # the reproducer: a strided gradient used to be copied, the copy freed after begin()
    "strided-gradient": """
        g = np.zeros(2_000_000, np.float32)[::2]
        plan = _C.make_plan("topk", 10**6, "float32", 1, options=dict(ratio=0.01))
        try:
            plan.begin(g)
        except ValueError as e:
            assert "contiguous" in str(e), e
            print("OK refused")
        else:
            plan.next()
            print("OK ran")
    """,
    "topk-dropped-gradient": """
        n = 10**6
        plan = _C.make_plan("topk", n, "float32", 1, options=dict(ratio=0.01))
        plan.begin(np.full(n, 0.5, np.float32))  # the caller keeps no reference
        run_local(plan)
        print("OK")
    """,
    "dense-dropped-gradient": """
        n = 10**6
        plan = _C.make_plan("allreduce", n, "float32", 1)
        plan.begin(np.full(n, 0.5, np.float32))
        run_local(plan)
        print("OK")
    """,
    "onebit-dropped-gradient-and-output": """
        n = 10**6
        plan = onebit_plan(1, n=n)
        plan.begin(np.full(n, 0.5, np.float32), out=np.zeros(n, np.float32))
        run_local(plan)
        print("OK")
    """,
    "powersgd-dropped-gradient": """
        st = _C.PowerSGDState([[1000, 1000]], rank=2)
        plan = _C.PowerSGDPlan(st, 1)
        plan.begin([np.full((1000, 1000), 0.5, np.float32)])
        run_local(plan)
        print("OK")
    """,
}


@pytest.mark.parametrize("case", sorted(CRASH_CASES))
def test_plan_memory_safety_in_subprocess(case):
    code = _PRELUDE + textwrap.dedent(CRASH_CASES[case])
    # a fixed mmap threshold: every large free unmaps at once, so a use after free faults
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.startswith("OK"), r.stdout + r.stderr


# ---- reshard_state: every input checked, the inputs left as they were ---------------------------
def test_reshard_state_refuses_hostile_inputs():
    import gc as pygc
    states = []
    for r in range(2):
        p = _C.make_plan("topk", 64, "float32", 2, rank=r, options=dict(ratio=0.25))
        states.append(p.state_dict())
    before = [bytes(s) for s in states]
    out = _C.reshard_state(states, 3, 1)
    _C.make_plan("topk", 64, "float32", 3, rank=1, options=dict(ratio=0.25)).load_state_dict(out)
    assert _C.reshard_state(states, 2, 1) == states[1]  # as many ranks: its own bytes
    with pytest.raises(TypeError):
        _C.reshard_state(states + ["not bytes"], 3, 0)
    with pytest.raises(TypeError):
        _C.reshard_state(b"".join(states), 3, 0)  # one blob, not a list of states
    for bad_world, bad_rank in ((0, 0), (3, 3), (3, -1)):
        with pytest.raises(ValueError, match="not a rank"):
            _C.reshard_state(states, bad_world, bad_rank)
    with pytest.raises(ValueError, match="no states"):
        _C.reshard_state([], 2, 0)
    with pytest.raises(ValueError, match="rank 1's state_dict"):
        _C.reshard_state([states[0], states[1][:-5]], 3, 0)
    assert [bytes(s) for s in states] == before  # inputs untouched
    del states
    pygc.collect()
    assert isinstance(out, bytes) and len(out) > 0  # the result owns its memory
