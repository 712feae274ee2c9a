"""A JAX training loop over a cache, for tests/jax/test_feed.py's kill test.

python train_jax.py CACHE CKPT LOG EVERY KILL_AFTER SIGNAL_FILE: trains 3 epochs of JaxLoader
batches, logs each batch it trained on (step, epoch, labels), saves the loader's state with the step
every EVERY steps (atomically, as a checkpoint would), and after KILL_AFTER steps (0: never) touches
SIGNAL_FILE and waits to be killed. With CKPT present, it resumes from it (the test resumes in its
own process instead, to start one process less).
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import nbkit
from nbkit.jax import JaxLoader


@jax.jit
def train_step(w, image):
    return w + jnp.mean(image.astype(jnp.float32))


def main():
    cache, ckpt, log, every, kill_after, signal_file = sys.argv[1:]
    every, kill_after = int(every), int(kill_after)
    loader = JaxLoader(nbkit.CachedDataset.open(cache), 5, seed=3, drop_last=True)
    step, start_epoch = 0, 0
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["loader"])
        step, start_epoch = saved["step"], saved["loader"]["epoch"]
        print(f"resumed at step {step}", flush=True)

    w = jnp.zeros(())
    with open(log, "a") as out:
        for epoch in range(start_epoch, 3):
            loader.set_epoch(epoch)
            for image, half, label in loader:
                assert isinstance(image, jax.Array) and isinstance(label, jax.Array)
                w = train_step(w, image)
                out.write(json.dumps([step, epoch, np.asarray(label).tolist()]) + "\n")
                out.flush()
                step += 1
                if step % every == 0:
                    with open(ckpt + ".tmp", "w") as f:
                        json.dump({"step": step, "loader": loader.state_dict()}, f)
                    os.replace(ckpt + ".tmp", ckpt)
                if step == kill_after:
                    open(signal_file, "w").close()
                    time.sleep(600)  # killed here, with batches read ahead that it never trained on


if __name__ == "__main__":
    main()
