"""The order backward() runs regions in: every region reachable from the root, each after all
regions that feed it gradients."""

from __future__ import annotations


def regions_in_order(root) -> list:
    """Reverse depth-first post-order. A region is marked when it is expanded, not when it is
    pushed, so one reached by two paths finishes after every region downstream of it."""
    order, expanded_regions, stack = [], set(), [(root, False)]
    while stack:
        region, expanded = stack.pop()
        if expanded:
            order.append(region)
            continue
        if region in expanded_regions:
            continue
        expanded_regions.add(region)
        stack.append((region, True))
        for upstream in region.next_regions:
            if upstream not in expanded_regions:
                stack.append((upstream, False))
    return order[::-1]
