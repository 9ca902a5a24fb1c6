"""A compiled function's region plans (forward, backward, saved slots) as formulas of one
symbol: ir/symbolic.py fits each plan, this keeps the slots and recomputed chains that point
into the forward plan pointing at the instantiated forward's values."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plans import RegionPlans
from .symbolic import SymbolicError, SymbolicPlan, fit_plans


@dataclass
class SymbolicRegion:
    template: RegionPlans
    forward: SymbolicPlan
    backward: SymbolicPlan | None

    def at(self, n: int) -> RegionPlans:
        forward, mapping = self.forward.at(n)
        backward = self.backward.at(n)[0] if self.backward is not None else None
        template = self.template
        return replace(
            template,
            forward=forward,
            backward=backward,
            saved=[replace(s, forward=mapping.get(s.forward, s.forward)) for s in template.saved],
            recomputed=[
                replace(
                    r,
                    forward=mapping.get(r.forward, r.forward),
                    nbytes=mapping.get(r.forward, r.forward).type.nbytes,
                    chain=tuple(mapping.get(v, v) for v in r.chain),
                )
                for r in template.recomputed
            ],
        )


def fit_regions(plans: list[RegionPlans], sizes: list[int]) -> SymbolicRegion:
    """The region plans of one function at three sizes as one SymbolicRegion."""
    first = plans[0]
    if any(p.n_outputs != first.n_outputs or p.wrt != first.wrt for p in plans):
        raise SymbolicError("the region's outputs change with the size")
    if any([s.source for s in p.saved] != [s.source for s in first.saved] for p in plans):
        raise SymbolicError("the region saves other buffers at another size")
    if any(len(p.recomputed) != len(first.recomputed) for p in plans):
        raise SymbolicError("the backward recomputes other values at another size")
    if any((p.backward is None) != (first.backward is None) for p in plans):
        raise SymbolicError("the region has a backward plan at one size only")
    forward = fit_plans([p.forward for p in plans], sizes)
    backward = None
    if first.backward is not None:
        backward = fit_plans([p.backward for p in plans], sizes)
    return SymbolicRegion(first, forward, backward)
