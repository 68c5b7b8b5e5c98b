# SPDX-License-Identifier: Apache-2.0
"""Fashion-MNIST CNN accuracy of configurations side by side, seed by seed: the setting of the
question whether 4-bit `quant` trains worse than 2 and 8 bits (SGD lr 0.05, momentum 0.9 in the
optimizer, 32 samples per rank and step, the full training and test sets).

Usage: python -m experiments.quant_bits_screen CONFIGS SEEDS STEPS WORLD
  CONFIGS  comma-separated configurations of experiments.fashion_mnist (plain, quant4, quant8, ...)
  SEEDS    comma-separated seeds
  STEPS    steps per run (0: one epoch)
  WORLD    gloo ranks on this machine
Prints one line per run: configuration, seed, test accuracy (%), last logged loss, wall seconds."""
import sys
import time

from experiments import fashion_mnist as fm


def main() -> None:
    cfgs = sys.argv[1].split(",")
    seeds = [int(s) for s in sys.argv[2].split(",")]
    steps, world = int(sys.argv[3]), int(sys.argv[4])
    for cfg in cfgs:
        for seed in seeds:
            t = time.time()
            args = dict(config=cfg, seed=seed, lr=0.05, momentum=0.9, batch=32, epochs=1,
                        steps=steps, model="cnn", train_subset=60000, test_subset=10000,
                        log_every=100000)
            r = fm.run_config(args, world=world)
            print(f"{cfg:10s} seed {seed} acc {100 * r['accuracy']:.2f} "
                  f"loss {r.get('final_loss', '?')} {time.time() - t:.0f}s", flush=True)


if __name__ == "__main__":  # (the ranks are forked from a server that re-imports this module)
    main()
