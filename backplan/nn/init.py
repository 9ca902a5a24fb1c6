"""bp.nn.init: parameter initialisers with PyTorch's fan-in and fan-out conventions.

>>> import backplan as bp
>>> bp.nn.init.kaiming_normal(bp.random.key(0), (16, 3, 3, 3)).shape
(16, 3, 3, 3)
"""

from backplan.tracer.init import fans, kaiming_normal, xavier_uniform

__all__ = ["fans", "kaiming_normal", "xavier_uniform"]
