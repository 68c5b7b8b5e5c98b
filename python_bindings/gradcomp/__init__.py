# SPDX-License-Identifier: Apache-2.0
"""gradcomp: gradient compression and straggler mitigation for data-parallel training.

``import gradcomp`` needs only NumPy; the PyTorch integration lives in ``gradcomp.torch`` and
imports torch when it is used. Here, under ``gradcomp.<name>``: the compressors, the allreduce
plans (built by ``make_plan(name, ...)``), the reduce-scatter and allgather plans of sharded
training (``make_shard_plan``), PowerSGD, the checkpoint tools (``reshard_state``,
``settle_step``) and the option enums. The DropCompute and QSR analytics (latency traces, the
tau* search, the simulator, the Quadratic Synchronization Rule) are one module,
``gradcomp.dropcompute``, which needs no torch either.
"""
from gradcomp._C import (  # noqa: F401
    BucketPlan,
    CastAllreducePlan,
    CastRoute,
    Collective,
    DenseAllreducePlan,
    DType,
    OneBitAllreducePlan,
    OneBitCompressor,
    OneBitScaling,
    OnNonFinite,
    Orthogonalization,
    Payload,
    Plan,
    PlanForm,
    PowerSGDPlan,
    PowerSGDState,
    QuantPlan,
    QuantRounding,
    QuantScale,
    RandomKAllreducePlan,
    RandomKCompressor,
    SelectMethod,
    ShardCastPlan,
    TopKAllreducePlan,
    TopKCompressor,
    TopKExchange,
    TopKRoute,
    built_with_cuda,
    cpu_threads,
    cuda_device_count,
    dry_run,
    families,
    make_plan,
    make_shard_plan,
    plan_defaults,
    plan_is_stateful,
    plan_names,
    quant_bits_per_value,
    reshard_state,
    set_cpu_threads,
    settle_step,
    shard_plan_defaults,
    shard_plan_names,
    topk_indices,
)

from gradcomp import dropcompute  # noqa: E402,F401  (the DropCompute and QSR analytics)

# The multi-bit plan's class was named for one of its three forms; the old name stays importable.
QuantAllreducePlan = QuantPlan

__version__ = "0.1.0"

__all__ = [
    "BucketPlan", "CastAllreducePlan", "CastRoute", "Collective", "DType", "OneBitScaling",
    "OnNonFinite", "Orthogonalization", "SelectMethod", "TopKExchange", "TopKRoute", "DenseAllreducePlan", "OneBitAllreducePlan",
    "OneBitCompressor", "Payload", "Plan", "PowerSGDPlan", "PowerSGDState", "RandomKAllreducePlan",
    "RandomKCompressor", "TopKAllreducePlan", "TopKCompressor", "built_with_cuda", "cpu_threads",
    "cuda_device_count", "dry_run", "families", "make_plan", "plan_defaults", "plan_is_stateful", "plan_names",
    "reshard_state", "set_cpu_threads", "settle_step", "topk_indices", "dropcompute",
    "PlanForm", "QuantPlan", "QuantAllreducePlan", "QuantRounding", "QuantScale", "ShardCastPlan",
    "make_shard_plan", "quant_bits_per_value", "shard_plan_defaults", "shard_plan_names",
]
