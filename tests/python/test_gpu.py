# SPDX-License-Identifier: Apache-2.0
"""The DDP hooks and compress_fsdp on a CUDA device with NCCL (skipped without one).

What a GPU user runs, checked end to end (the kernels themselves are checked against their CPU
twins by the C++ CUDA suites):

- every family's hook on CUDA tensors trains like the same hook on the CPU (world size 1, NCCL
  for the CUDA model, a gloo group for the CPU one, in one process; the losses agree to 2%);
- a checkpoint taken mid-run on the GPU resumes to the same parameters as the run that never
  stopped;
- hook("auto") runs its trial and decides (its consensus on the device);
- torch's own fp16 GradScaler with autocast: the scaler's overflow steps are the hook's skipped
  steps, and the model trains;
- the hooks under a side stream (torch.cuda.stream) give the default stream's result;
- a DDP step with a hook under CUDA graph capture fails with GraphCaptureError (never a hang or
  a capture invalidated without a word), the hook's state unchanged, and training goes on;
- two ranks on the one GPU (NCCL refuses that on most versions: then skipped with NCCL's reason);
- compress_fsdp (quant gradients, int8 parameters) on CUDA with NCCL (torch 2.x).

GRADCOMP_TEST_DEVICE=cpu runs the same checks over gloo on the CPU (the logic of this file, for a
machine without a GPU); by default they need CUDA and gradcomp built with it.
"""
import os
import pickle
import traceback

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp.torch as gt  # noqa: E402

from ddp_util import (Net, finish, free_port, gpu_suite_device, make_data,  # noqa: E402
                      train_losses)
from fsdp_util import have_fully_shard  # noqa: E402

DEV, pytestmark = gpu_suite_device()

FAMILIES = [
    ("topk", dict(ratio=0.05)),
    ("topk", dict(ratio=0.05, momentum=0.9)),
    ("randomk", dict(ratio=0.05)),
    ("onebit", dict()),
    ("quant", dict(bits=4)),
    ("powersgd", dict(rank=2)),
    ("fp16", dict()),
    ("bf16", dict()),
]
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for n, o in FAMILIES]
STEPS = 8


def _entry(rank, world, port, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()  # (ddp_util: every rank done, then no interpreter teardown)


def _spawn(fn, world=1, *args):
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def _model(device, group=None, seed=0):
    torch.manual_seed(seed)
    net = Net(d_hidden=600).to(device)
    ids = [0] if device.type == "cuda" else None
    # a small bucket cap: several buckets, each its own plan
    return DDP(net, device_ids=ids, process_group=group, bucket_cap_mb=0.01)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def _vs_cpu(rank, world, name, opts):
    dev = torch.device(DEV)
    data = make_data(rank, STEPS)
    runs = {}
    for where, group in ((dev, None), (torch.device("cpu"), dist.new_group(backend="gloo"))):
        model = _model(where, group)
        state, hook = gt.hook(name, process_group=group, model=model, **opts)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        runs[where.type if group is None else "cpu-ref"] = (train_losses(model, opt, data, where),
                                                           _flat(model), state)
    (la, pa, sa), (lb, pb, sb) = runs[DEV], runs["cpu-ref"]
    assert sa.iter == sb.iter == STEPS
    assert lb[-1] < lb[0], f"{name}: the CPU reference does not train: {lb}"
    for s, (a, b) in enumerate(zip(la, lb)):
        assert abs(a - b) <= 0.02 * abs(b) + 1e-6, f"{name} step {s}: loss {a} on {DEV}, {b} on CPU"
    scale = pb.abs().max().item()
    assert (pa - pb).abs().max().item() <= 0.02 * scale, f"{name}: parameters drift from the CPU"


@pytest.mark.parametrize("name,opts", FAMILIES, ids=IDS)
def test_hook_trains_like_its_cpu_twin(name, opts):
    _spawn(_vs_cpu, 1, name, opts)


def _auto(rank, world):
    """hook("auto") through its trial to a decision on the device: the ranks' measurements are
    averaged on the bucket's device (NCCL takes no CPU tensors; a CPU consensus failed there with
    "No backend type associated with device type cpu" once the trial ended)."""
    dev = torch.device(DEV)
    model = _model(dev)
    state, hook = gt.hook("auto", model=model, start_iter=1, trial_steps=2)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    decided_at = 1 + len(state.candidates) * 2
    losses = train_losses(model, opt, make_data(rank, decided_at + 4), dev)
    assert len(state.trials) == 1 and state.trials[0]["iter"] == decided_at, state.trials
    assert state.choices and set(state.choices.values()) <= set(state.candidates), state.choices
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0], losses


def test_auto_decides_on_the_device():
    _spawn(_auto, 1)


def _resume(rank, world, name, opts):
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device(DEV)
    data = make_data(rank, STEPS)
    half = STEPS // 2
    model = _model(dev)
    state, hook = gt.hook(name, model=model, **opts)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_losses(model, opt, data[:half], dev)
    params = [p.detach().clone() for p in model.module.parameters()]
    sd = state.state_dict()
    train_losses(model, opt, data[half:], dev)
    straight = _flat(model)

    model2 = _model(dev, seed=1)  # other initial weights: everything comes from the checkpoint
    with torch.no_grad():
        for p, q in zip(model2.module.parameters(), params):
            p.copy_(q)
    state2, hook2 = gt.hook(name, model=model2, **opts)
    state2.load_state_dict(sd)
    model2.register_comm_hook(state2, hook2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    train_losses(model2, opt2, data[half:], dev)
    resumed = _flat(model2)
    assert state2.iter == state.iter == STEPS
    diff = (resumed - straight).abs().max().item()
    assert diff <= 1e-6 * straight.abs().max().item(), f"{name}: resumed run differs by {diff}"


@pytest.mark.parametrize("name,opts", [f for f in FAMILIES if f[0] in
                                       ("topk", "onebit", "quant", "powersgd")],
                         ids=[i for i, f in zip(IDS, FAMILIES) if f[0] in
                              ("topk", "onebit", "quant", "powersgd")])
def test_checkpoint_resumes_the_same_run(name, opts):
    _spawn(_resume, 1, name, opts)


def _scaler(rank, world, name, opts):
    dev = torch.device(DEV)
    data = make_data(rank, 40)
    model = _model(dev)
    state, hook = gt.hook(name, model=model, **opts)
    model.register_comm_hook(state, hook)
    # (DGC's momentum correction is SGD with momentum 0.9: a tenth of the rate)
    opt = torch.optim.SGD(model.parameters(), lr=0.005 if "momentum" in opts else 0.05)
    # an initial scale that overflows fp16: the first steps are skipped as the scaler halves it
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0 ** 24, growth_interval=1000)
    losses, skips = [], 0
    for x, y in data:
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        with torch.autocast(DEV, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skips += scaler.get_scale() < before
        losses.append(loss.item())
    assert skips >= 1, "the initial scale did not overflow"
    if name != "fp16":  # (the stateless cast passes the Inf on to the scaler: nothing to skip)
        assert state.skipped_steps == skips, (state.skipped_steps, skips)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    first = sum(losses[skips:skips + 5]) / 5
    last = sum(losses[-5:]) / 5
    assert last < first, f"{name}: the loss did not go down after the overflow steps: {losses}"


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler: torch 2.x")
@pytest.mark.parametrize("name,opts", [f for f in FAMILIES if f[0] != "bf16"],
                         ids=[i for i, f in zip(IDS, FAMILIES) if f[0] != "bf16"])
def test_fp16_grad_scaler_overflow_steps_are_skipped(name, opts):
    _spawn(_scaler, 1, name, opts)


def _side_stream(rank, world):
    if DEV != "cuda":
        return
    dev = torch.device(DEV)
    data = make_data(rank, STEPS)
    out = []
    for use_side in (False, True):
        model = _model(dev)
        state, hook = gt.hook("topk", model=model, ratio=0.05)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if use_side:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                train_losses(model, opt, data, dev)
            torch.cuda.current_stream().wait_stream(side)
        else:
            train_losses(model, opt, data, dev)
        torch.cuda.synchronize()
        out.append(_flat(model))
    assert (out[0] - out[1]).abs().max().item() <= 1e-6 * out[0].abs().max().item()


@pytest.mark.skipif(DEV != "cuda", reason="streams are CUDA's")
def test_side_stream_gives_the_default_streams_result():
    _spawn(_side_stream, 1)


def _graph_capture(rank, world):
    """A DDP step with a gradcomp hook under CUDA graph capture: the hook refuses it with
    GraphCaptureError (raised by loss.backward()), nothing of its state changes, and the next
    ordinary step runs and trains on."""
    from gradcomp.torch._hook import GraphCaptureError
    dev = torch.device(DEV)
    warm = 11
    data = make_data(rank, warm + 3)
    for name, opts in (("quant", dict(bits=4)), ("topk", dict(ratio=0.05))):
        # DDP made and warmed up on a side stream, as torch's CUDA-graph notes ask for DDP: DDP
        # keeps its gradient accumulators, whose stream is the one DDP was made on, and
        # accumulation on the default stream invalidates a capture before any hook runs (seen on
        # an H200, with torch's warning "The AccumulateGrad node's stream does not match"); and
        # at least 11 eager iterations, since DDP's forward logs runtime statistics (a host
        # synchronisation) at its 10th (seen on an H200: cudaErrorStreamCaptureUnsupported in
        # DDP's _pre_forward, before any hook ran, after 4 warm-up iterations)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model = _model(dev)
            state, hook = gt.hook(name, model=model, **opts)
            model.register_comm_hook(state, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            train_losses(model, opt, data[:warm], dev)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        it, sd = state.iter, pickle.dumps(state.state_dict())
        x, y = data[warm][0].to(dev), data[warm][1].to(dev)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(GraphCaptureError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                torch.nn.functional.mse_loss(model(x), y).backward()
        torch.cuda.synchronize()
        assert state.iter == it and pickle.dumps(state.state_dict()) == sd, name
        losses = train_losses(model, opt, data[warm + 1:], dev)
        assert state.iter == it + 2, (name, state.iter, it)
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
        assert all(l == l for l in losses), name


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs are CUDA's")
def test_graph_capture_is_refused_clearly():
    _spawn(_graph_capture, 1)


def _two_ranks(rank, world):
    dev = torch.device(DEV)
    data = make_data(rank, STEPS)
    for name, opts in (("topk", dict(ratio=0.05)), ("quant", dict(bits=4)),
                       ("powersgd", dict(rank=2))):
        model = _model(dev)
        state, hook = gt.hook(name, model=model, **opts)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        skipped = 0
        for s, (x, y) in enumerate(data):
            x, y = x.to(dev), y.to(dev)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if s == 5 and rank == 1:
                loss = loss * float("inf")  # an overflow on one rank: every rank skips
            loss.backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
            else:
                skipped += 1
        assert skipped == 1 and state.skipped_steps == 1, (name, skipped, state.skipped_steps)
        flat = _flat(model).to(dev)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], g) for g in gathered), f"{name}: ranks differ"


def test_two_ranks_on_one_device():
    try:
        _spawn(_two_ranks, 2)
    except Exception as e:  # noqa: BLE001 (NCCL's refusal is read from the child's traceback)
        text = "".join(traceback.format_exception_only(type(e), e))
        if DEV == "cuda" and ("Duplicate GPU" in text or "duplicate GPU" in text):
            pytest.skip("NCCL refuses two ranks on one device: " + text.strip().splitlines()[-1])
        raise


def _fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard
    dev = torch.device(DEV)
    torch.manual_seed(0)
    model = Net(d_hidden=256).to(dev)
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer)
    fully_shard(model)
    comp = gt.compress_fsdp(model, grads="quant", bits=4, params="int8")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = train_losses(model, opt, make_data(rank, 20), dev)
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    totals = comp.totals()
    assert totals, "no compressed collective ran"
    sd = comp.state_dict()
    comp.load_state_dict(sd)
    assert pickle.dumps(comp.state_dict()) == pickle.dumps(sd), "the state changed on a reload"


@pytest.mark.skipif(not have_fully_shard(), reason="FSDP2 (fully_shard): torch 2.x")
def test_compress_fsdp_trains():
    _spawn(_fsdp, 1)
