"""Counter-based random numbers: threefry-2x32 (20 rounds, the generator JAX uses), keyed by a
tensor. A key is an i64[2] tensor holding two 32-bit words; every draw is a pure function of the
key and the element's position, so the compiled kernel, the reference interpreter and a
recomputation in backward all produce the same bits.

Counters: element block j of a draw hashes the counter pair (j >> 32, j & 0xFFFFFFFF); the two
output words serve two f32 elements or one f64 element. `random_split` hashes (0xFFFFFFFF, c)
for child c, a counter no draw uses (draws have fewer than 2**40 elements), so a child key never
repeats bits its parent handed out.
"""

import numpy as np

from ..errors import DtypeError, ShapeError
from ..registry import AttrSpec, OpDef, register
from ..types import TensorType, np_dtype

MASK32 = 0xFFFFFFFF
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
PARITY = 0x1BD11BDA
SPLIT_COUNTER = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & MASK32


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds on uint64 arrays holding 32-bit words (Random123's
    definition, as in JAX's prng.py). Returns the two output words."""
    ks = (k0, k1, k0 ^ k1 ^ PARITY)
    x0 = (x0 + ks[0]) & MASK32
    x1 = (x1 + ks[1]) & MASK32
    for block in range(5):
        for r in ROTATIONS[block % 2]:
            x0 = (x0 + x1) & MASK32
            x1 = _rotl(x1, r) ^ x0
        x0 = (x0 + ks[(block + 1) % 3]) & MASK32
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & MASK32
    return x0, x1


def _key_words(key):
    if np.any((key < 0) | (key > MASK32)):
        raise ValueError(
            f"key words must lie in [0, 2**32), got {key.tolist()}; make keys with "
            "bp.random.key(seed) and bp.random.split"
        )
    k = key.astype(np.uint64)
    return k[0], k[1]


def _blocks(key, count: int):
    """The two words of counter blocks 0 .. count-1."""
    k0, k1 = _key_words(key)
    j = np.arange(count, dtype=np.uint64)
    return threefry2x32(k0, k1, j >> np.uint64(32), j & np.uint64(MASK32))


def uniform_from_words(w0, w1, dtype: str, size: int):
    """[0, 1) floats that are exact in the dtype: 24 random bits for f32, 53 for f64."""
    if dtype == "f32":
        words = np.stack([w0, w1], axis=1).reshape(-1)[:size]
        return ((words >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)).astype(
            np.float32
        )
    high = (w0 >> np.uint64(5)).astype(np.float64)
    low = (w1 >> np.uint64(6)).astype(np.float64)
    return (high * 67108864.0 + low) * 2.0**-53


def _key_infer(types, op):
    key = types[0]
    if key.dtype != "i64" or key.shape != (2,):
        raise DtypeError(
            f"needs a key, an i64 tensor of shape (2,), got {key}; make keys with "
            "bp.random.key(seed) and bp.random.split(key)"
        )


def _draw_infer(types, attrs):
    _key_infer(types, "random")
    if attrs["dtype"] not in ("bf16", "f16", "f32", "f64"):  # 16 bits: f32 draws, rounded
        raise DtypeError(f"draws floats (bf16, f16, f32 or f64), not {attrs['dtype']}")
    return TensorType(attrs["dtype"], attrs["shape"])


def _uniform_ref(key, shape, dtype):
    size = int(np.prod(shape, dtype=np.int64))
    blocks = (size + 1) // 2 if dtype == "f32" else size
    w0, w1 = _blocks(key, blocks)
    return uniform_from_words(w0, w1, dtype, size).reshape(shape)


def _normal_ref(key, shape, dtype):
    """Box-Muller on each counter block, in float64: block j gives elements 2j and 2j+1."""
    size = int(np.prod(shape, dtype=np.int64))
    w0, w1 = _blocks(key, (size + 1) // 2)
    u1 = (w0.astype(np.float64) + 1.0) * 2.0**-32  # (0, 1]: log is finite
    u2 = w1.astype(np.float64) * 2.0**-32
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * np.pi * u2
    pairs = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return pairs.reshape(-1)[:size].astype(np_dtype(dtype)).reshape(shape)


DRAW_ATTRS = {"shape": AttrSpec("shape"), "dtype": AttrSpec("dtype")}

register(
    OpDef(
        "random_uniform",
        (1,),
        _draw_infer,
        _uniform_ref,
        "opaque",
        differentiable=False,
        attrs=DRAW_ATTRS,
        doc="floats in [0, 1) from a key (threefry-2x32); no gradient",
        cost="one_pass",  # backward rebuilds a dropout mask from its key rather than saving it
    )
)
register(
    OpDef(
        "random_normal",
        (1,),
        _draw_infer,
        _normal_ref,
        "opaque",
        differentiable=False,
        attrs=DRAW_ATTRS,
        doc="standard normal floats from a key (threefry-2x32, Box-Muller); no gradient",
    )
)


def _split_infer(types, attrs):
    _key_infer(types, "random_split")
    if attrs["count"] < 1:
        raise ShapeError(f"count must be at least 1, got {attrs['count']}")
    return TensorType("i64", (attrs["count"], 2))


def _split_ref(key, count):
    k0, k1 = _key_words(key)
    c = np.arange(count, dtype=np.uint64)
    y0, y1 = threefry2x32(k0, k1, np.full(count, SPLIT_COUNTER, np.uint64), c)
    return np.stack([y0, y1], axis=1).astype(np.int64)


register(
    OpDef(
        "random_split",
        (1,),
        _split_infer,
        _split_ref,
        "opaque",
        differentiable=False,
        attrs={"count": AttrSpec("int")},
        doc="`count` new keys from one key, as rows of an i64[count, 2]; no gradient",
    )
)
