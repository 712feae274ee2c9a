"""A training loop fed by a Grain DataLoader over a cache, for tests/jax/test_source.py's kill test.

python train_grain.py CACHE CKPT LOG EVERY KILL_AFTER SIGNAL_FILE: iterates :func:`loader` (2
prefetch worker processes, 3 shuffled epochs), logs each batch it trained on (step, labels), saves
Grain's iterator state with the step every EVERY steps (atomically, as a checkpoint would), and
after KILL_AFTER steps touches SIGNAL_FILE and waits to be killed.
"""

import base64
import json
import os
import sys
import time

import grain
import numpy as np
from absl import flags

from nbkit.jax import GrainSource

BATCH, EPOCHS, SEED = 5, 3, 3


def loader(cache):
    """The job's loader: the same in the killed process and where it resumes."""
    if not flags.FLAGS.is_parsed():  # grain 0.2.18 with jaxlib >= 0.11 (docs/jax.md)
        flags.FLAGS.mark_as_parsed()
    source = GrainSource(cache)
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, num_epochs=EPOCHS, seed=SEED)
    return grain.DataLoader(data_source=source, sampler=sampler, worker_count=2,
                            operations=[grain.transforms.Batch(BATCH, drop_remainder=True)])


def encode(state) -> str:
    return base64.b64encode(state if isinstance(state, bytes) else json.dumps(state).encode()).decode()


def main():
    cache, ckpt, log, every, kill_after, signal_file = sys.argv[1:]
    every, kill_after = int(every), int(kill_after)
    it = iter(loader(cache))
    with open(log, "a") as out:
        for step, (image, half, label) in enumerate(it, start=1):
            out.write(json.dumps([step - 1, np.asarray(label).tolist()]) + "\n")
            out.flush()
            if step % every == 0:
                with open(ckpt + ".tmp", "w") as f:
                    json.dump({"step": step, "grain": encode(it.get_state())}, f)
                os.replace(ckpt + ".tmp", ckpt)
            if step == kill_after:
                open(signal_file, "w").close()
                time.sleep(600)  # killed here, with batches its workers read ahead that it never trained on


if __name__ == "__main__":
    main()
