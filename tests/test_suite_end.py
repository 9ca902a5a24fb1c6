"""tests/conftest.py's end of a worker's run: the collections pytest runs as the worker
unconfigures, after it reported the end to the controller, must not walk the worker's heap.
Five full collections of it took longer than the 5 s execnet allows on a loaded box, and its
SIGINT ended the suite with a KeyboardInterrupt in hypothesis's gc callback."""

import gc
import types

import conftest


def _worker_session():
    return types.SimpleNamespace(config=types.SimpleNamespace(workerinput={"workerid": "gw0"}))


def test_a_worker_ends_its_run_with_its_heap_out_of_the_collections():
    heap = [[i] for i in range(50_000)]  # live objects a full collection would walk
    assert gc.get_freeze_count() < len(heap)
    try:
        conftest.pytest_sessionfinish(_worker_session())
        walked = len(gc.get_objects())  # what a later full collection walks
        assert gc.get_freeze_count() >= len(heap), gc.get_freeze_count()
        assert walked < len(heap) // 10, walked
    finally:
        gc.unfreeze()
    assert len(gc.get_objects()) >= len(heap)  # back in the collector for the next tests


def test_garbage_left_at_the_end_is_collected_not_frozen():
    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle
    ref = __import__("weakref").ref(cycle)
    del cycle
    try:
        conftest.pytest_sessionfinish(_worker_session())
        assert ref() is None  # collected before the freeze: its finalisers still reported
    finally:
        gc.unfreeze()


def test_a_run_in_one_process_is_left_as_it_is():
    before = gc.get_freeze_count()
    conftest.pytest_sessionfinish(types.SimpleNamespace(config=types.SimpleNamespace()))
    assert gc.get_freeze_count() == before
