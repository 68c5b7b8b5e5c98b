# SPDX-License-Identifier: Apache-2.0
"""_C.make_plan from Python: the one path by which the hooks build plans. Options cross as plain
Python values (checked by type in C++), defaults come from C++, every family's plan honours the
BucketPlan contract, and the plan classes have no second constructor."""
import numpy as np
import pytest

import gradcomp
from gradcomp import _C
from gradcomp.bench import run_local  # drives a world-size-1 plan
from gradcomp.torch import COMPRESSORS


def test_names_and_defaults_are_the_hooks():
    assert set(_C.plan_names()) == set(COMPRESSORS)
    for name in _C.plan_names():
        fam = COMPRESSORS[name]
        assert fam.defaults == _C.plan_defaults(name)
        assert fam.stateful == _C.plan_is_stateful(name)
    assert _C.plan_defaults("onebit")["block_size"] == 128
    assert _C.plan_defaults("topk")["ratio"] == 0.001
    with pytest.raises(ValueError, match="unknown compressor 'top-k'"):
        _C.plan_defaults("top-k")


def test_every_extension_name_is_exported():
    """A new binding reaches users under gradcomp.<name> (or gradcomp.dropcompute for the
    analytics): the package's export list drifted once, missing the quant and shard plans.
    collective_names / elem_type_names list the C++ enums for test_layering.py, which checks
    that the torch driver handles every one."""
    internal = {"collective_names", "elem_type_names"}
    public = {n for n in dir(_C) if not n.startswith("_")}
    exported = set(gradcomp.__all__) | set(dir(gradcomp.dropcompute))
    assert public - exported == internal
    for n in gradcomp.__all__:
        assert hasattr(gradcomp, n), n


def test_the_registry_is_the_one_list_of_families():
    """Every list of families the package offers is read from the C++ registry: the names, the
    shard forms, and the hook's compressors with their traits."""
    fams = _C.families()
    assert [f["name"] for f in fams] == _C.plan_names()
    assert [f["name"] for f in fams if f["shard_forms"]] == _C.shard_plan_names()
    for f in fams:
        assert f["stateful"] == _C.plan_is_stateful(f["name"])
        assert bool(f["state_kinds"]) == f["stateful"]
        for form in f["shard_forms"]:
            assert isinstance(_C.shard_plan_defaults(f["name"], form), dict)
        for form in {"reduce_scatter", "allgather"} - set(f["shard_forms"]):
            with pytest.raises(ValueError, match=f"has no {form} form"):
                _C.shard_plan_defaults(f["name"], form)
    torch = pytest.importorskip("torch")  # noqa: F841
    from gradcomp.torch import COMPRESSORS
    assert list(COMPRESSORS) == _C.plan_names()
    for f in fams:
        fam = COMPRESSORS[f["name"]]
        assert (fam.stateful, fam.uses_shapes) == (f["stateful"], f["uses_shapes"])


@pytest.mark.parametrize("name", _C.plan_names())
def test_every_family_takes_its_defaults_and_averages_in_place(name):
    n = 1000
    p = _C.make_plan(name, n, "float32", 1, options=_C.plan_defaults(name))
    assert isinstance(p, _C.BucketPlan) and p.numel == n and p.stateful == _C.plan_is_stateful(name)
    g = np.linspace(-1, 1, n, dtype=np.float32)
    p.begin(g)
    run_local(p)
    assert np.isfinite(g).all()
    st = p.state_dict()
    assert (len(st) > 0) == p.stateful
    p.load_state_dict(st)
    if not p.stateful:
        with pytest.raises(ValueError, match="carries no state"):
            p.load_state_dict(b"x")


@pytest.mark.parametrize("opts, message", [
    (dict(rato=0.1), r"unknown option\(s\) \['rato'\]"),
    (dict(ratio="0.1"), "ratio must be a number, got a name"),
    (dict(nesterov=1), "nesterov must be a flag"),
    (dict(warmup_ratios=[0.5, True]), "warmup_ratios must be a list of numbers"),
    (dict(warmup_ratios=0.5), "warmup_ratios must be a list of numbers, got a number"),
    (dict(seed=2**70), "does not fit a 64-bit integer"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(method=object()), "has type object"),
    (dict(ratio=1.5), "ratio"),
])
def test_bad_options_are_value_errors(opts, message):
    with pytest.raises(ValueError, match=message):
        _C.make_plan("topk", 100, "float32", 1, options=opts)


def test_integers_are_accepted_for_reals():
    p = _C.make_plan("topk", 100, "float32", 1, options=dict(ratio=1, warmup_ratios=[1, 0.5],
                                                                warmup_steps=10))
    assert p.stateful


def test_plan_classes_are_built_by_make_plan_only():
    for cls in (_C.DenseAllreducePlan, _C.CastAllreducePlan, _C.TopKAllreducePlan,
                _C.RandomKAllreducePlan, _C.OneBitAllreducePlan):
        with pytest.raises(TypeError):
            cls(100, "float32", 1)


def test_powersgd_flat_bucket_equals_its_tensor_list():
    shapes = [[30, 20], [], [7]]
    n = 600 + 1 + 7
    a = _C.make_plan("powersgd", n, "float32", 1, shapes=shapes, options=dict(rank=2))
    b = _C.make_plan("powersgd", n, "float32", 1, shapes=shapes, options=dict(rank=2))
    for step in range(3):
        g = np.random.default_rng(step).standard_normal(n).astype(np.float32)
        h = g.copy()
        a.begin(g)
        run_local(a)
        b.begin([h[:600].reshape(30, 20), h[600:601].reshape(()), h[601:]])
        run_local(b)
        assert np.array_equal(g, h)
    with pytest.raises(ValueError, match="shapes hold 607 elements"):
        _C.make_plan("powersgd", n, "float32", 1, shapes=[[30, 20], [7]])


def test_randomk_sends_the_buckets_small_tensors_whole():
    """dense_below: the tensors of the bucket with fewer elements are averaged exactly
    every step; the density applies to the others. With momentum 0.9 and world size 1, a
    tensor sent whole gets SGD-with-momentum's update (u = 0.9 u + g) every step."""
    shapes = [[8, 4], [20000], [], [3, 1000]]  # 32 + 20000 + 1 + 3000
    n = 32 + 20000 + 1 + 3000
    whole = np.zeros(n, bool)
    whole[:32] = True
    whole[20032:] = True
    p = _C.make_plan("randomk", n, "float32", 1, shapes=shapes,
                     options=dict(ratio=0.01, momentum=0.9, dense_below=5000))
    assert p.dense_numel == np.count_nonzero(whole) == 3033
    u = np.zeros(n)
    for step in range(4):
        g = np.random.default_rng(step).standard_normal(n).astype(np.float32)
        out = g.copy()
        p.begin(out)
        run_local(p)
        u = 0.9 * u + g
        assert np.allclose(out[whole], u[whole], rtol=1e-5, atol=1e-5), step
        assert np.count_nonzero(out[~whole]) == 200, step  # ceil(0.01 x 20000)
    # no shapes, or dense_below=0: every element sampled
    for kw in (dict(), dict(shapes=shapes, options=dict(ratio=0.01, dense_below=0))):
        q = _C.make_plan("randomk", n, "float32", 1, **kw)
        g = np.ones(n, np.float32)
        q.begin(g)
        run_local(q)
        assert np.count_nonzero(g) == int(np.ceil(0.01 * n)), kw
    with pytest.raises(ValueError, match="segments hold 23000 elements but the buffer has 23033"):
        _C.make_plan("randomk", n, "float32", 1, shapes=[[20000], [3000]])
    with pytest.raises(ValueError, match="shape dimension -1"):
        _C.make_plan("randomk", n, "float32", 1, shapes=[[-1, 5], [20000]])
    with pytest.raises(ValueError, match="dense_below must be >= 0"):
        _C.make_plan("randomk", n, "float32", 1, shapes=shapes, options=dict(dense_below=-1))


def test_onebit_out_is_keyword_only():
    p = _C.make_plan("onebit", 64, "float32", 1)
    g, out = np.ones(64, np.float32), np.zeros(64, np.float32)
    p.begin(g, out=out)
    run_local(p)
    assert np.allclose(out, 1.0, atol=0.5) and np.array_equal(g, np.ones(64, np.float32))
    with pytest.raises(TypeError):
        p.begin(g, out)  # the second positional argument is the stream, as for every plan


def test_version_exports_make_plan():
    assert gradcomp.make_plan is _C.make_plan


def test_bound_enums_stand_for_their_option_names():
    """gradcomp.TopKRoute.dense etc. are accepted wherever the name is, with the same result."""
    import pickle
    assert _C.TopKRoute.dense.name == "dense" and _C.OneBitScaling.sign_l1.name == "sign_l1"
    g0 = np.linspace(-1, 1, 500, dtype=np.float32)
    out = []
    for opts in (dict(route="dense", method="exact", value_dtype="float16"),
                 dict(route=_C.TopKRoute.dense, method=_C.SelectMethod.exact,
                      value_dtype=_C.DType.float16)):
        p = _C.make_plan("topk", 500, "float32", 1, options=dict(opts, ratio=0.1))
        g = g0.copy()
        p.begin(g)
        run_local(p)
        assert p.route_stats["last_route"] == "dense"
        out.append(g)
    assert np.array_equal(out[0], out[1])
    p = _C.make_plan("onebit", 64, "float32", 1,
                     options=dict(scaling=_C.OneBitScaling.sign_l1, rotate=False))
    assert not p.rotate
    assert pickle.loads(pickle.dumps(_C.CastRoute.reduce_scatter)) is _C.CastRoute.reduce_scatter
    with pytest.raises(ValueError, match="ratio must be a number, got a name"):
        _C.make_plan("topk", 10, "float32", 1, options=dict(ratio=_C.TopKRoute.dense))


def test_every_shard_plan_from_python_at_world_size_one():
    """make_shard_plan, shard_plan_names and shard_plan_defaults called directly (FSDP2 builds
    these plans, and its tests need torch 2.x: on torch 1.13, where the asan stage runs, this is
    what calls them): every compressor's reduce-scatter and allgather form with its defaults on
    one rank, where the chunk is the whole bucket and the average is the input within the codec's
    rounding; the stateful ones give their state back bitwise."""
    n = 1024
    tol = {"allreduce": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
    for name in _C.shard_plan_names():
        for form in ("reduce_scatter", "allgather"):
            if (name, form) == ("topk", "allgather"):
                with pytest.raises(ValueError, match="no allgather form"):
                    _C.shard_plan_defaults(name, form)
                continue
            opts = _C.shard_plan_defaults(name, form)
            p = _C.make_shard_plan(name, n, "float32", 1, form, options=opts)
            assert isinstance(p, _C.BucketPlan) and p.numel == n, (name, form)
            g0 = np.linspace(-1, 1, n, dtype=np.float32)
            g = g0.copy()
            p.begin(g)
            run_local(p)
            err = np.abs(g - g0)
            if name == "topk":  # about ratio * n values kept, each exactly (one rank's sum)
                kept = g != 0
                assert 1 <= kept.sum() <= 4 * opts["ratio"] * n
                assert np.array_equal(g[kept], g0[kept])
            elif name == "quant":  # half a quantisation step of the block's largest value
                step = 1.0 / (2 ** (opts["bits"] - 1) - 1)
                assert err.max() <= 0.5 * step * 1.0001, (form, err.max())
            else:  # a family without a bound here (the C++ conformance suite checks it
                # against its reference): one rank's average still resembles the input
                assert err.max() <= tol.get(name, 0.25), (name, form, err.max())
            st = p.state_dict()
            assert (len(st) > 0) == p.stateful
            if p.stateful:
                p.load_state_dict(st)
                assert p.state_dict() == st


def test_settle_step_takes_back_the_other_plans_of_a_skipped_step():
    """settle_step from Python: a bucket whose gradient holds a NaN skips the step
    (on_nonfinite='skip'), and settle_step undoes the step the other bucket took, so its state is
    as before the step; a step no plan skipped is left alone."""
    n = 256
    a, b = (_C.make_plan("topk", n, "float32", 1, options=dict(ratio=0.1)) for _ in range(2))
    for p in (a, b):
        p.begin(np.linspace(-1, 1, n, dtype=np.float32))
        run_local(p)
    assert _C.settle_step([a, b]) is False
    before = b.state_dict()
    bad = np.linspace(-1, 1, n, dtype=np.float32)
    bad[3] = np.nan
    a.begin(bad)
    run_local(a)
    b.begin(np.linspace(-1, 1, n, dtype=np.float32))
    run_local(b)
    assert a.skipped and not b.skipped and b.state_dict() != before
    assert _C.settle_step([a, b]) is True
    assert b.state_dict() == before and a.skipped_steps == 1 and b.skipped_steps == 0


def test_quant_bits_per_value_counts_the_scales():
    assert _C.quant_bits_per_value() == 4 + 32 / 128
    assert _C.quant_bits_per_value(bits=8, block_size=64, scale_dtype="float16") == 8 + 16 / 64
    with pytest.raises(ValueError):
        _C.quant_bits_per_value(bits=3)
