"""bp.random: counter-based random numbers keyed by tensors (threefry-2x32, as JAX).

>>> import backplan as bp
>>> k1, k2 = bp.random.split(bp.random.key(0))
>>> bp.random.uniform(k1, (3,)).shape
(3,)
"""

from backplan.tracer.random import bernoulli, key, normal, split, uniform

__all__ = ["bernoulli", "key", "normal", "split", "uniform"]
