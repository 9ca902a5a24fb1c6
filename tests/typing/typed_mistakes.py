"""Wrong uses the public annotations must catch (each line one mypy error)."""

import backplan as bp

x = bp.tensor([1.0, 2.0])
count: int = bp.exp(x)
bp.softmax(x, axis="last")
bp.compile(x)
shape: str = x.sum(axis=0).shape
bp.value_and_grad(bp.exp, background="yes")
