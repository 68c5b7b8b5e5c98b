# SPDX-License-Identifier: Apache-2.0
"""The top-k family through the Python bindings: zero-copy arrays, dtypes, errors."""
import numpy as np
import pytest

import gradcomp


def test_import_without_torch_names_core_api():
    assert hasattr(gradcomp, "TopKCompressor")
    assert isinstance(gradcomp.built_with_cuda(), bool)
    n = gradcomp.cuda_device_count()
    assert n >= 0 and (gradcomp.built_with_cuda() or n == 0)


@pytest.mark.parametrize("n", [1, 7, 1023, 100_003])
def test_topk_indices_match_numpy_reference(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    k = max(1, n // 100)
    got = gradcomp.topk_indices(x, k, method="exact")
    # reference: stable sort by -|x| (ties by index), first k, ascending
    order = np.lexsort((np.arange(n), -np.abs(x)))[:k]
    np.testing.assert_array_equal(got, np.sort(order))


def test_encode_decode_round_trip_and_residual():
    n = 10_000
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    c = gradcomp.TopKCompressor(n, ratio=0.01, method="exact")
    p = gradcomp.Payload()
    c.encode(x, p)
    out = np.zeros(n, np.float32)
    c.decode_add(p.array(), out, 1.0)
    sent = out != 0
    assert sent.sum() == 100
    np.testing.assert_array_equal(out[sent], x[sent])
    st = c.last_stats
    assert st["payload_bytes"] == p.nbytes
    assert st["compression_ratio"] == pytest.approx(4 * n / p.nbytes)
    # state round trip
    c2 = gradcomp.TopKCompressor(n, ratio=0.01, method="exact")
    c2.load_state_dict(c.state_dict())
    assert c2.step == 1


def test_torch_dtypes_zero_copy():
    torch = pytest.importorskip("torch")
    n = 3000
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        g = torch.randn(n, dtype=dt)
        c = gradcomp.TopKCompressor(n, ratio=0.01, method="exact")
        p = gradcomp.Payload()
        c.encode(g, p)
        out = torch.zeros(n)
        c.decode_add(p.array(), out)
        nz = out != 0
        assert int(nz.sum()) == 30
        assert torch.equal(out[nz], g.float()[nz])


PLAN_ONLY = ("route", "exchange", "latency_s", "bandwidth_Bps", "clip_scaling", "dense_below",
             "on_nonfinite")


@pytest.mark.parametrize("name,cls", [("topk", "TopKCompressor"), ("randomk", "RandomKCompressor")])
def test_codec_options_are_the_plan_table(name, cls):
    """The codecs read their keyword options with make_plan's table: the same names, types and
    defaults (a codec given plan_defaults' values encodes byte for byte like one given nothing);
    the plan-only options and everything make_plan refuses are ValueErrors."""
    C = getattr(gradcomp, cls)
    d = {k: v for k, v in gradcomp.plan_defaults(name).items() if k not in PLAN_ONLY}
    g = np.random.default_rng(1).standard_normal(5003).astype(np.float32)
    pa, pb = gradcomp.Payload(), gradcomp.Payload()
    C(5003, tensor_id=3).encode(g, pa)
    C(5003, tensor_id=3, **d).encode(g, pb)
    assert bytes(pa.array()) == bytes(pb.array())
    for k in PLAN_ONLY:
        if k in gradcomp.plan_defaults(name):
            with pytest.raises(ValueError, match=f"'{k}' belongs to the {name} plan"):
                C(10, **{k: gradcomp.plan_defaults(name)[k]})
    with pytest.raises(ValueError, match="unknown option"):
        C(10, bogus=1)
    with pytest.raises(ValueError, match="ratio must be a number"):
        C(10, ratio="x")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        C(10, seed=-1)
    with pytest.raises(ValueError, match="momentum"):
        C(10, momentum=1.5)
    with pytest.raises(TypeError):
        C(10, 0.1)  # options are keyword-only


def test_numpy_numbers_and_arrays_are_options():
    """NumPy scalars and 1-D arrays are accepted where Python numbers and lists are (codecs,
    make_plan and the hooks read options alike), and give the same bytes."""
    g = np.random.default_rng(2).standard_normal(4000).astype(np.float32)
    pa, pb = gradcomp.Payload(), gradcomp.Payload()
    gradcomp.TopKCompressor(4000, ratio=0.05, warmup_ratios=[0.5], warmup_steps=2,
                            seed=3).encode(g, pa)
    gradcomp.TopKCompressor(4000, ratio=np.float64(0.05),
                            warmup_ratios=np.array([0.5]), warmup_steps=np.int64(2),
                            seed=np.uint64(3)).encode(g, pb)
    assert bytes(pa.array()) == bytes(pb.array())
    c = gradcomp.TopKCompressor(10, ratio=np.float32(0.5))  # float32 0.5 is exact
    assert c is not None
    with pytest.raises(ValueError, match="list of numbers"):
        gradcomp.TopKCompressor(10, warmup_ratios=["a"], warmup_steps=1)
    with pytest.raises(ValueError, match="has type bytes"):
        gradcomp.TopKCompressor(10, ratio=b"x")


def test_bad_input_raises_value_error_and_keeps_state():
    with pytest.raises(ValueError, match="ratio"):
        gradcomp.TopKCompressor(10, ratio=0.0)
    with pytest.raises(ValueError, match="ratio"):
        gradcomp.TopKCompressor(10, ratio=1.5)
    with pytest.raises(ValueError, match="method"):
        gradcomp.TopKCompressor(10, method="bogus")
    c = gradcomp.TopKCompressor(100, ratio=0.1)
    p = gradcomp.Payload()
    with pytest.raises(ValueError, match="99 elements"):
        c.encode(np.ones(99, np.float32), p)
    x = np.ones(100, np.float32)
    x[7] = np.nan
    with pytest.raises(ValueError, match="index 7"):
        c.encode(x, p)
    assert c.step == 0
    with pytest.raises(ValueError, match="dtype"):
        c.encode(np.ones(100, np.float64), p)
    with pytest.raises(ValueError, match="corrupt payload"):
        c.decode_add(np.zeros(70, np.uint8), np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="k must be"):
        gradcomp.topk_indices(np.ones(5, np.float32), 6)


def test_cuda_tensor_in_cpu_build_is_clear_error():
    if gradcomp.built_with_cuda():
        pytest.skip("built with CUDA")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        gradcomp.TopKCompressor(10, device="cuda")


def test_randomk_same_seed_same_payload():
    n = 5000
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    a = gradcomp.RandomKCompressor(n, ratio=0.02, seed=3)
    b = gradcomp.RandomKCompressor(n, ratio=0.02, seed=3)
    pa, pb = gradcomp.Payload(), gradcomp.Payload()
    a.encode(x, pa)
    b.encode(x, pb)
    np.testing.assert_array_equal(pa.array(), pb.array())


def test_onebit_compressor_binding_round_trip():
    from gradcomp import _C

    n = 1000
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    c = _C.OneBitCompressor(n, 1, scaling="sign_l1", block_size=0)
    p = gradcomp.Payload()
    c.encode(x, p)
    out = np.zeros(n, np.float32)
    c.decode_add(p.array(), out)
    scale = np.abs(x).mean()  # ||x||_1 / n, one scale for the tensor
    np.testing.assert_allclose(out, np.where(x >= 0, scale, -scale), rtol=1e-5)
    assert c.step == 1 and c.numel == n
    assert c.last_stats["payload_bytes"] == p.nbytes
    c2 = _C.OneBitCompressor(n, 1, scaling="sign_l1", block_size=0)
    c2.load_state_dict(c.state_dict())
    assert c2.step == 1
    with pytest.raises(ValueError, match="scaling"):
        _C.OneBitCompressor(n, 1, scaling="sign_l3")


def test_onebit_codec_reads_the_plans_options():
    """The per-tensor codec and the onebit plan share one option table: the codec's defaults are
    the plan's (an L2 scale per block of 128), column means is a scaling the codec takes (block 0),
    and what only the plan does is refused."""
    from gradcomp import _C

    rows, cols = 50, 20
    n = rows * cols
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    x[:128] *= 100.0  # one loud block: a per-block scale keeps the others' magnitude

    def decoded(**kw):
        c = _C.OneBitCompressor(rows, cols, **kw)
        p = gradcomp.Payload()
        c.encode(x.reshape(rows, cols), p)
        out = np.zeros((rows, cols), np.float32)
        c.decode_add(p.array(), out)
        return out.reshape(n), p.nbytes

    default, nb = decoded()
    explicit, nb2 = decoded(scaling="sign_l2", block_size=128)
    np.testing.assert_array_equal(default, explicit)
    assert nb == nb2
    old_spelling, _ = decoded(scaling="sign_l2", chunk_size=128)
    np.testing.assert_array_equal(default, old_spelling)
    # every block of 128 has its own L2 scale: sqrt(mean(x_b^2)) (the last block is partial)
    for s in range(0, n, 128):
        blk = x[s:s + 128]
        scale = np.sqrt(np.mean(blk.astype(np.float64) ** 2))
        np.testing.assert_allclose(np.abs(default[s:s + 128]), scale, rtol=1e-5)
    assert _C.plan_defaults("onebit")["scaling"] == "sign_l2"
    assert _C.plan_defaults("onebit")["block_size"] == 128
    # column means: per column, the mean of the non-negative and of the negative entries
    cm, _ = decoded(scaling="column_means")
    m = x.reshape(rows, cols)
    want = np.where(m >= 0, [m[:, j][m[:, j] >= 0].mean() for j in range(cols)],
                    [m[:, j][m[:, j] < 0].mean() for j in range(cols)])
    np.testing.assert_allclose(cm.reshape(rows, cols), want, rtol=1e-5)
    for bad, match in [({"scaling": "column_means", "block_size": 128}, "column"),
                       ({"rotate": True}, "rotate"), ({"momentum": 0.9}, "momentum"),
                       ({"on_nonfinite": "raise"}, "on_nonfinite"), ({"bogus": 1}, "bogus"),
                       ({"block_size": 128, "chunk_size": 128}, "chunk_size")]:
        with pytest.raises(ValueError, match=match):
            _C.OneBitCompressor(rows, cols, **bad)
