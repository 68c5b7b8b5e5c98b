# SPDX-License-Identifier: Apache-2.0
"""The experiments: end-to-end training on real data with the DDP hooks (Fashion-MNIST), the
benchmarks and sweeps over emulated links, and what they share (rank launcher, latency emulation,
network namespaces, report). Not part of the wheel, which ships the library only: they run from a
clone's root, ``python -m experiments.<name>`` (e.g. ``python -m experiments.fashion_mnist
--quick``), against the installed gradcomp."""
