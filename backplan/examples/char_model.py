"""A character-level model (one causal self-attention block) trained on the source of a
standard-library module, then sampled with bp.random (Gumbel-max: argmax of logits plus Gumbel
noise drawn from a key). One compiled call per training step does the forward, the backward and
the Adam update, with params and optimizer state donated so the update writes in place.

    python -m backplan.examples.char_model
"""

from __future__ import annotations

import inspect
import math
import textwrap
import time

import numpy as np

import backplan as bp

CONTEXT = 32
WIDTH = 64
LEARNING_RATE = 3e-3
OPTIMIZER = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adam(LEARNING_RATE))


def corpus(module=textwrap) -> tuple[np.ndarray, list[str]]:
    """The module's source as character ids, and the alphabet."""
    text = inspect.getsource(module)
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    return np.array([index[c] for c in text], np.int64), alphabet


def init_params(key, vocab: int) -> dict:
    keys = bp.random.split(key, 6)
    init = bp.nn.init.xavier_uniform

    def dense(k, n_in, n_out):
        return init(k, (n_in, n_out), layout="in_out")

    return {
        "embed": bp.random.normal(keys[0], (vocab, WIDTH)) * 0.1,
        "pos": bp.random.normal(keys[1], (CONTEXT, WIDTH)) * 0.1,
        "qkv": dense(keys[2], WIDTH, 3 * WIDTH),
        "proj": dense(keys[3], WIDTH, WIDTH),
        "mlp": dense(keys[4], WIDTH, 4 * WIDTH),
        "out": dense(keys[5], 4 * WIDTH, vocab),
    }


CAUSAL = np.triu(np.full((CONTEXT, CONTEXT), -1e9, np.float32), k=1)


def logits(params: dict, ids):
    """(batch, CONTEXT) ids -> (batch, CONTEXT, vocab) next-character scores."""
    h = bp.embedding(ids, params["embed"]) + params["pos"]
    qkv = bp.layer_norm(h) @ params["qkv"]
    q, k, v = qkv[..., :WIDTH], qkv[..., WIDTH : 2 * WIDTH], qkv[..., 2 * WIDTH :]
    scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(WIDTH)) + bp.tensor(CAUSAL)
    h = h + (bp.softmax(scores, axis=-1) @ v) @ params["proj"]
    return bp.gelu(bp.layer_norm(h) @ params["mlp"], approximate="tanh") @ params["out"]


def loss_fn(params, ids, targets):
    return bp.cross_entropy(logits(params, ids), targets)


@bp.compile(donate_argnums=(0, 1))
def train_step(params, opt_state, ids, targets):
    """(params, opt_state, loss): forward, backward and the clipped Adam update in one plan."""
    loss, grads = bp.value_and_grad(loss_fn)(params, ids, targets)
    params, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return params, opt_state, loss


@bp.compile
def next_char(params, ids, key):
    """Gumbel-max sampling of the character after the last position of each row."""
    last = logits(params, ids)[:, -1, :]
    u = bp.random.uniform(key, last.shape, low=1e-7, high=1.0)
    return bp.argmax(last - bp.log(-bp.log(u)), axis=1)


def sample(params, alphabet, prompt_ids: np.ndarray, length: int, key) -> str:
    ids = list(prompt_ids[-CONTEXT:])
    for _ in range(length):
        key, draw = bp.random.split(key)
        window = bp.tensor(np.array([ids[-CONTEXT:]], np.int64))
        ids.append(int(next_char(params, window, draw).numpy()[0]))
    return "".join(alphabet[i] for i in ids[CONTEXT:])


def train(steps: int = 300, batch_size: int = 32, seed: int = 0, sample_length: int = 80):
    """Train and sample: {'losses', 'sample', 'step_ms'}."""
    data, alphabet = corpus()
    key = bp.random.key(seed)
    key, init_key = bp.random.split(key)
    params = init_params(init_key, len(alphabet))
    opt_state = OPTIMIZER.init(params)
    rng = np.random.default_rng(seed)
    losses, times = [], []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - CONTEXT - 1, batch_size)
        windows = np.stack([data[s : s + CONTEXT + 1] for s in starts])
        begin = time.perf_counter()
        params, opt_state, loss = train_step(
            params, opt_state, bp.tensor(windows[:, :-1]), bp.tensor(windows[:, 1:])
        )
        losses.append(loss.item())
        times.append(time.perf_counter() - begin)
    text = sample(params, alphabet, data[:CONTEXT], sample_length, key)
    return {
        "losses": losses,
        "sample": text,
        "step_ms": 1000 * float(np.median(times[1:] or times)),
    }


def main() -> None:
    result = train()
    losses = result["losses"]
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f}, {result['step_ms']:.2f} ms per step")
    print("sample:", repr(result["sample"]))


if __name__ == "__main__":
    main()
