"""The static memory planner: safety invariants on random schedules, in-place reuse rules, arena
sizes against the live-bytes lower bound, and a simulated execution of random programs with every
value living in its planned arena slice."""

import copy
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backplan.ir import memory_plan
from backplan.ir.errors import BackplanError
from backplan.ir.memory_plan import (
    BufferRequest,
    MemoryPlanError,
    assign_memory,
    lower_bound_bytes,
)

ITEMSIZE = {"bool": 1, "i64": 8, "f32": 4, "f64": 8}
DTYPE_NAMES = tuple(ITEMSIZE)
ARENAS = ("scratch", "saved")


# ---------------------------------------------------------------- random schedules


@st.composite
def fresh_requests(draw, key, count):
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    first = draw(st.integers(-1, 10))
    reuse = draw(st.lists(st.integers(0, count - 1), max_size=2))
    return BufferRequest(
        key,
        nbytes=draw(st.integers(0, 64)) * ITEMSIZE[dtype],
        dtype=dtype,
        first_step=first,
        last_step=first + draw(st.integers(0, 6)),
        arena=draw(st.sampled_from(ARENAS)),
        reuse=tuple(reuse),
    )


@st.composite
def successor_requests(draw, key, earlier):
    """A buffer written where an earlier one dies, hinting at it: mostly legal, sometimes not."""
    old = draw(st.sampled_from(earlier))
    dtype = draw(st.sampled_from((old.dtype,) * 3 + DTYPE_NAMES))
    arena = draw(st.sampled_from((old.arena,) * 3 + ARENAS))
    items = draw(st.integers(0, old.nbytes // ITEMSIZE[old.dtype] + 4))
    extra = draw(st.lists(st.sampled_from([r.key for r in earlier]), max_size=2))
    reuse = draw(st.permutations([old.key, *extra]))
    first = old.last_step
    last = first + draw(st.integers(0, 6))
    in_step = draw(st.booleans())  # may take over one made and last read at its first step
    return BufferRequest(
        key, items * ITEMSIZE[dtype], dtype, first, last, arena, tuple(reuse), in_step
    )


@st.composite
def schedules(draw, max_buffers=24):
    count = draw(st.integers(0, max_buffers))
    requests = []
    for key in range(count):
        if requests and draw(st.booleans()):
            requests.append(draw(successor_requests(key, requests)))
        else:
            requests.append(draw(fresh_requests(key, count)))
    return requests


def legal_takeover(new, old):
    """The in-place rule, written out again independently of the planner."""
    return (
        (new.arena, new.dtype) == (old.arena, old.dtype)
        and new.nbytes <= old.nbytes
        and old.last_step == new.first_step
        and (old.first_step < old.last_step or (new.in_step and not old.reuse))
    )


def lives_overlap(a, b):
    return a.first_step <= b.last_step and b.first_step <= a.last_step


def byte_range(placement):
    start = placement.offset * ITEMSIZE[placement.dtype]
    return start, start + placement.nbytes


def assert_safe(requests, plan, alignment_bytes):
    by_key = {r.key: r for r in requests}
    assert set(plan.placements) == set(by_key)
    for r in requests:
        p = plan.placements[r.key]
        assert (p.arena, p.dtype, p.nbytes) == (r.arena, r.dtype, r.nbytes)
        assert byte_range(p)[0] % alignment_bytes == 0
        assert p.offset >= 0
        assert p.offset + r.nbytes // ITEMSIZE[r.dtype] <= plan.arena_sizes[(r.arena, r.dtype)]
    for i, a in enumerate(requests):
        for b in requests[i + 1 :]:
            pa, pb = plan.placements[a.key], plan.placements[b.key]
            (a0, a1), (b0, b1) = byte_range(pa), byte_range(pb)
            share_bytes = (pa.arena, pa.dtype) == (pb.arena, pb.dtype) and a0 < b1 and b0 < a1
            if share_bytes and lives_overlap(a, b):
                pair = {plan.in_place.get(a.key), plan.in_place.get(b.key)}
                assert a.key in pair or b.key in pair, f"{a} and {b} share bytes while both live"
                assert pa.offset == pb.offset


def assert_hints_followed(requests, plan):
    """Every takeover is legal, each buffer is taken over at most once, and a hint is ignored
    only when it is illegal or its buffer went to someone else."""
    by_key = {r.key: r for r in requests}
    taken = list(plan.in_place.values())
    assert len(taken) == len(set(taken))
    for new_key, old_key in plan.in_place.items():
        new, old = by_key[new_key], by_key[old_key]
        assert old_key in new.reuse and legal_takeover(new, old)
        assert plan.placements[new_key].offset == plan.placements[old_key].offset
    for new in requests:
        if new.key not in plan.in_place:
            for old_key in new.reuse:
                old = by_key.get(old_key)
                assert old is None or not legal_takeover(new, old) or old_key in taken


@settings(max_examples=300, deadline=None)
@given(schedules(), st.sampled_from([8, 64, 256]))
def test_random_schedules_get_safe_plans(requests, alignment_bytes):
    plan = assign_memory(requests, alignment_bytes)
    assert_safe(requests, plan, alignment_bytes)
    assert_hints_followed(requests, plan)
    bounds = lower_bound_bytes(requests)
    arena_bytes = plan.arena_bytes()
    for key, bound in bounds.items():
        assert arena_bytes[key] >= bound
    assert plan.peak_bytes == sum(arena_bytes.values()) >= sum(bounds.values())


@settings(max_examples=100, deadline=None)
@given(schedules())
def test_plans_are_deterministic(requests):
    first = assign_memory(requests)
    again = assign_memory(copy.deepcopy(requests))
    assert first == again


def _best_fit_by_scan(chains, alignment):
    """The placement rule written as a plain scan of every placed buffer: what the planner's
    array form must give, offset for offset."""
    order = sorted(
        range(len(chains)), key=lambda i: (-chains[i][0].nbytes, chains[i][0].first_step)
    )
    offsets, placed, end = [0] * len(chains), [], 0
    for i in order:
        nbytes, first, last = chains[i][0].nbytes, chains[i][0].first_step, chains[i][-1].last_step
        if nbytes == 0:
            continue
        taken = sorted(
            (offsets[j], offsets[j] + r.nbytes)
            for j in placed
            for r in chains[j]
            if r.first_step <= last and first <= r.last_step
        )
        best, best_gap, prev_end = None, None, 0
        for start, stop in taken:
            aligned = -(-prev_end // alignment) * alignment
            if start - aligned >= nbytes and (best_gap is None or start - aligned < best_gap):
                best, best_gap = aligned, start - aligned
            prev_end = max(prev_end, stop)
        offsets[i] = -(-prev_end // alignment) * alignment if best is None else best
        placed.append(i)
        end = max(end, offsets[i] + nbytes)
    return offsets, end


@settings(max_examples=200, deadline=None)
@given(schedules(), st.sampled_from([8, 64, 256]))
def test_best_fit_places_as_the_plain_scan_does(requests, alignment_bytes):
    in_place = memory_plan._resolve_in_place(requests)
    by_arena = {}
    for chain in memory_plan._chains(requests, in_place):
        by_arena.setdefault((chain[0].arena, chain[0].dtype), []).append(chain)
    for chains in by_arena.values():
        expected = _best_fit_by_scan(chains, alignment_bytes)
        assert memory_plan._place_best_fit(chains, alignment_bytes) == expected


@st.composite
def uniform_chains(draw):
    """Mostly one size, as a deep uniform network's activations are (the run the planner
    places with a free list, memory_plan._largest_by_sweep), a few of other sizes after
    them, zero-byte buffers, many ties of first step, sizes off the alignment, and now and
    then a two-buffer chain: of equal buffers (a GEMM's epilogue result over its product),
    which the run takes as one buffer, or a smaller second, which ends the run early."""
    big = draw(st.sampled_from([64, 100, 192, 4000]))
    sizes = st.sampled_from([big, big, big, big, 4, 0, 2 * big])
    chains = []
    for key in range(draw(st.integers(1, 40))):
        first = draw(st.integers(-1, 25))
        last = first + draw(st.sampled_from([0, 1, 2, 3, 8, 30]))
        chain = [BufferRequest(key, draw(sizes), "f32", first, last)]
        if draw(st.integers(0, 15)) == 0:
            nxt = last + draw(st.integers(0, 4))
            second = draw(st.sampled_from([chain[0].nbytes, chain[0].nbytes, 4]))
            chain.append(BufferRequest((key, 1), min(second, chain[0].nbytes), "f32", last, nxt))
        chains.append(chain)
    return chains


@settings(max_examples=400, deadline=None)
@given(uniform_chains(), st.sampled_from([4, 64, 256]))
def test_the_free_list_of_the_largest_size_places_as_the_plain_scan_does(chains, alignment):
    """The leading run of equal buffers goes through the sorted free list, the rest through
    the array scan: together, the same offsets and arena end as the plain scan, to the byte
    (a free list that merged gaps wrongly, or took the last of equal gaps, fails here)."""
    assert memory_plan._place_best_fit(chains, alignment) == _best_fit_by_scan(chains, alignment)


def test_a_deep_uniform_backward_is_placed_by_the_free_list():
    """Thousands of equal activations, each beside hundreds of held ones: the run the free
    list places is all of them, and the offsets are the plain scan's."""
    chains = [
        [BufferRequest(i, 16384, "f32", i, i + (600 if i % 3 == 0 else 2))] for i in range(900)
    ]
    offsets = [0] * len(chains)
    order = list(range(len(chains)))
    assert memory_plan._largest_by_sweep(chains, order, 64, offsets) == 900
    assert memory_plan._place_best_fit(chains, 64) == _best_fit_by_scan(chains, 64)


def test_a_uniform_chain_of_epilogues_over_products_is_placed_by_the_free_list():
    """Each layer's product taken over in its step by the epilogue's result (ir/layout.py
    _epilogues_over_products), beside held activations: every such chain is one buffer of the
    run the free list places (they went through the array scan: 2.2 s of 37 frontier plans),
    and the offsets are the plain scan's."""
    chains = []
    for i in range(0, 1800, 2):
        product = BufferRequest(i, 16384, "f32", i, i)
        result = BufferRequest(i + 1, 16384, "f32", i, i + (600 if i % 6 == 0 else 3))
        chains.append([product, result])
    offsets = [0] * len(chains)
    assert memory_plan._largest_by_sweep(chains, list(range(len(chains))), 64, offsets) == 900
    assert memory_plan._place_best_fit(chains, 64) == _best_fit_by_scan(chains, 64)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-1, 30), st.integers(0, 12)), min_size=1, max_size=60),
    st.sampled_from([64, 100, 4000]),
    st.sampled_from([4, 64, 256]),
)
def test_a_run_of_equal_buffers_ends_where_the_most_live_at_once_end(spans, nbytes, alignment):
    """Buffers of one size take slots of their aligned size, and a buffer goes above the
    highest slot in use only when no slot below it is free: the arena ends at the most
    buffers live at one step, in slots, the last one its own size (what a row's peak needs
    of the placement, without offsets)."""
    chains = [[BufferRequest(i, nbytes, "f32", f, f + d)] for i, (f, d) in enumerate(spans)]
    most = max(sum(1 for f, d in spans if f <= step <= f + d) for step in range(-1, 43))
    aligned = -(-nbytes // alignment) * alignment
    assert memory_plan._place_best_fit(chains, alignment)[1] == (most - 1) * aligned + nbytes


# ---------------------------------------------------------------- in-place hints, by hand


def test_legal_hint_is_taken_and_shares_the_slot():
    x = BufferRequest("x", 400, "f32", first_step=-1, last_step=2)
    y = BufferRequest("y", 400, "f32", first_step=2, last_step=4, reuse=("x",))
    plan = assign_memory([x, y])
    assert plan.in_place == {"y": "x"}
    assert plan.placements["x"].offset == plan.placements["y"].offset
    assert plan.arena_bytes() == {("scratch", "f32"): 400}
    assert lower_bound_bytes([x, y]) == {("scratch", "f32"): 400}


def test_without_the_hint_both_live_at_the_shared_step():
    x = BufferRequest("x", 384, "f32", first_step=-1, last_step=2)
    y = BufferRequest("y", 384, "f32", first_step=2, last_step=4)
    plan = assign_memory([x, y])
    assert plan.in_place == {}
    assert plan.placements["x"].offset != plan.placements["y"].offset
    assert plan.peak_bytes == 768 == sum(lower_bound_bytes([x, y]).values())


OLD = BufferRequest("old", 256, "f32", first_step=0, last_step=3)


@pytest.mark.parametrize(
    "why, old, new",
    [
        ("other dtype", OLD, BufferRequest("new", 256, "i64", 3, 5, reuse=("old",))),
        ("other arena", OLD, BufferRequest("new", 256, "f32", 3, 5, "saved", ("old",))),
        ("larger", OLD, BufferRequest("new", 260, "f32", 3, 5, reuse=("old",))),
        ("old still read later", OLD, BufferRequest("new", 256, "f32", 2, 5, reuse=("old",))),
        ("old dead already", OLD, BufferRequest("new", 256, "f32", 4, 5, reuse=("old",))),
        ("unknown key", OLD, BufferRequest("new", 256, "f32", 3, 5, reuse=("ghost",))),
        (
            "old lives one step",
            BufferRequest("old", 256, "f32", 3, 3),
            BufferRequest("new", 256, "f32", 3, 5, reuse=("old",)),
        ),
    ],
)
def test_illegal_hint_is_ignored(why, old, new):
    plan = assign_memory([old, new])
    assert plan.in_place == {}, why
    assert_safe([old, new], plan, 64)  # so they share no byte while both are live


def test_a_buffer_made_and_read_in_one_step_is_taken_over_in_that_step_only_when_asked():
    # a GEMM's product (made and last read at step 3) and its epilogue's result (written at
    # step 3, read until 5): one slot with the hint in_step, two without it
    product = BufferRequest("product", 256, "f32", 3, 3)
    result = BufferRequest("result", 256, "f32", 3, 5, reuse=("product",))
    apart = assign_memory([product, result])
    assert apart.in_place == {} and apart.arena_bytes() == {("scratch", "f32"): 512}
    over = assign_memory([product, result._replace(in_step=True)])
    assert over.in_place == {"result": "product"}
    assert over.arena_bytes() == {("scratch", "f32"): 256}
    # a product that takes over a buffer itself is not taken over in its step: three buffers
    # of one chain would share a slot at step 3
    operand = BufferRequest("operand", 256, "f32", 1, 3)
    taker = product._replace(reuse=("operand",), in_step=True)
    chained = assign_memory([operand, taker, result._replace(in_step=True)])
    assert "result" not in chained.in_place


def test_a_dying_buffer_goes_to_one_taker_only():
    x = BufferRequest("x", 256, "f64", first_step=0, last_step=2)
    a = BufferRequest("a", 256, "f64", first_step=2, last_step=3, reuse=("x",))
    b = BufferRequest("b", 128, "f64", first_step=2, last_step=3, reuse=("x",))
    plan = assign_memory([x, a, b])
    assert plan.in_place == {"a": "x"}
    assert_safe([x, a, b], plan, 64)


def test_first_legal_hint_wins_and_chains_share_one_slot():
    x = BufferRequest("x", 512, "f32", first_step=-1, last_step=1)
    w = BufferRequest("w", 512, "f32", first_step=-1, last_step=1)
    y = BufferRequest("y", 512, "f32", first_step=1, last_step=2, reuse=("w", "x"))
    z = BufferRequest("z", 256, "f32", first_step=2, last_step=3, reuse=("y",))
    plan = assign_memory([x, w, y, z])
    assert plan.in_place == {"y": "w", "z": "y"}
    assert plan.placements["w"].offset == plan.placements["y"].offset == plan.placements["z"].offset
    assert plan.peak_bytes == 1024


def test_zero_byte_buffers_take_no_room():
    empty = BufferRequest("e", 0, "f64", first_step=0, last_step=5)
    full = BufferRequest("f", 64, "f64", first_step=0, last_step=5)
    plan = assign_memory([empty, full])
    assert plan.arena_sizes == {("scratch", "f64"): 8}
    assert plan.placements["e"].nbytes == 0


@pytest.mark.parametrize(
    "request_, alignment, words",
    [
        (BufferRequest("a", 6, "f32", 0, 1), 64, ["'a'", "4-byte"]),
        (BufferRequest("b", 8, "c64", 0, 1), 64, ["'b'", "unknown dtype", "c64"]),
        (BufferRequest("c", 8, "f32", 3, 1), 64, ["'c'", "steps 3..1"]),
        (BufferRequest("d", 8, "f64", 0, 1), 4, ["'d'", "alignment 4"]),
        (BufferRequest("e", -8, "f64", 0, 1), 64, ["'e'", "-8 bytes"]),
    ],
)
def test_bad_requests_are_named(request_, alignment, words):
    with pytest.raises(MemoryPlanError) as info:
        assign_memory([request_], alignment)
    assert isinstance(info.value, BackplanError)
    for word in words:
        assert word in str(info.value)


def test_duplicate_keys_are_refused():
    with pytest.raises(MemoryPlanError, match="'k'.*twice"):
        assign_memory([BufferRequest("k", 8, "f64", 0, 1), BufferRequest("k", 8, "f64", 2, 3)])


# ---------------------------------------------------------------- how close to the bound


def program_like_schedule(rng, steps=80):
    """One buffer per step, sizes log-uniform from 256 B to 256 KiB, short-lived activations
    mixed with long-lived ones; half the steps are elementwise, same size as a dying input of
    the same arena and dtype and hinting at it."""
    requests = []
    for step in range(steps):
        lifetime = int(rng.geometric(0.4)) if rng.random() < 0.8 else int(rng.integers(10, steps))
        dying = [r for r in requests if r.last_step == step]
        hints = ()
        if dying and rng.random() < 0.5:
            like = dying[int(rng.integers(len(dying)))]
            nbytes, dtype, arena = like.nbytes, like.dtype, like.arena
            hints = tuple(r.key for r in dying)
        else:
            nbytes = int(2 ** rng.uniform(8, 18)) // 64 * 64
            dtype = "f32" if rng.random() < 0.85 else "f64"
            arena = "scratch" if rng.random() < 0.7 else "saved"
        requests.append(BufferRequest(step, nbytes, dtype, step, step + lifetime, arena, hints))
    return requests


def arena_to_bound_ratios(requests):
    plan, bounds = assign_memory(requests), lower_bound_bytes(requests)
    arena_bytes = plan.arena_bytes()
    per_arena = [arena_bytes[key] / bound for key, bound in bounds.items() if bound]
    return per_arena, plan.peak_bytes / sum(bounds.values())


def test_arenas_stay_close_to_the_live_bytes_bound():
    rng = np.random.default_rng(20261121)
    per_arena, totals = [], []
    for _ in range(60):
        arenas, total = arena_to_bound_ratios(program_like_schedule(rng))
        per_arena += arenas
        totals.append(total)
    assert min(per_arena) >= 1.0
    assert np.quantile(per_arena, 0.9) <= 1.05
    assert max(per_arena) <= 1.6
    assert np.median(totals) <= 1.02


# ---------------------------------------------------------------- simulated execution

BINARY = {
    "f": {"avg": lambda a, b: (a + b) * 0.5, "mul": np.multiply, "max": np.maximum},
    "i": {"add": np.add, "mul": np.multiply, "max": np.maximum},
    "b": {"and": np.logical_and, "xor": np.logical_xor},
}
UNARY = {
    "f": {"neg": np.negative, "sqrt_abs": lambda a: np.sqrt(np.abs(a))},
    "i": {"neg": np.negative, "mod7": lambda a: a % 7},
    "b": {"not": np.logical_not},
}
NP_DTYPE = {"bool": np.bool_, "i64": np.int64, "f32": np.float32, "f64": np.float64}
IR_DTYPE = {np.dtype(v): k for k, v in NP_DTYPE.items()}


def cast(x, target):
    """Casts that keep floats within [-1, 1] and integers small, so nothing overflows."""
    if x.dtype.kind == "f" and target == "i64":
        return (x * 100).astype(np.int64)
    if x.dtype.kind == "i" and target != "i64":
        return ((x % 7) / 7).astype(NP_DTYPE[target])
    return x.astype(NP_DTYPE[target])


def kernel(name):
    if name.startswith("to_"):
        return lambda x: cast(x, name[3:])
    fixed = {"less": np.less, "where": np.where, "head": lambda x: x[: len(x) // 2].copy()}
    fixed["tile"] = lambda x: np.concatenate([x, x])
    if name in fixed:
        return fixed[name]
    return next(table[name] for table in (*BINARY.values(), *UNARY.values()) if name in table)


@dataclass
class Step:
    name: str
    args: tuple
    hints: tuple  # values whose storage the output may take over (elementwise ops only)


def op_choices(values, first, partner):
    """(kernel name, args, elementwise) options for an op whose first argument is `first`."""
    x, kind = values[first], values[first].dtype.kind
    options = [(name, (first, partner), True) for name in BINARY[kind]]
    options += [(name, (first,), True) for name in UNARY[kind]]
    options += [
        (f"to_{d}", (first,), True) for d in ("f32", "f64", "i64") if IR_DTYPE[x.dtype] != d
    ]
    if kind != "b":
        options.append(("less", (first, partner), True))
    floats = [i for i, v in enumerate(values) if v.dtype.kind == "f" and v.shape == x.shape]
    if kind == "b" and floats:
        options.append(("where", (first, floats[-1], floats[0]), True))
    if len(x) >= 2:
        options.append(("head", (first,), False))
    if len(x) <= 24:
        options.append(("tile", (first,), False))
    return options


def random_array(rng):
    dtype, length = rng.choice(DTYPE_NAMES), int(rng.choice([4, 8, 12]))
    if dtype == "bool":
        return rng.random(length) < 0.5
    if dtype == "i64":
        return rng.integers(-50, 50, length)
    return rng.uniform(-1, 1, length).astype(NP_DTYPE[dtype])


def random_program(rng, n_inputs=3, n_steps=24):
    """Inputs, steps, and every value computed with fresh arrays (the reference run)."""
    values = [random_array(rng) for _ in range(n_inputs)]
    steps = []
    for _ in range(n_steps):
        first = int(rng.integers(len(values)))
        like = [
            i
            for i, v in enumerate(values)
            if (v.dtype, v.shape) == (values[first].dtype, values[first].shape)
        ]
        options = op_choices(values, first, int(rng.choice(like)))
        name, args, elementwise = options[int(rng.integers(len(options)))]
        values.append(kernel(name)(*(values[i] for i in args)))
        steps.append(Step(name, args, args if elementwise else ()))
    return n_inputs, steps, values


def program_requests(rng, n_inputs, steps, values):
    last_read = {i: s for s, step in enumerate(steps) for i in step.args}
    requests = []
    for i, value in enumerate(values):
        first = i - n_inputs if i >= n_inputs else -1
        hints = steps[first].hints if first >= 0 else ()
        arena = "scratch" if rng.random() < 0.8 else "saved"
        last = last_read.get(i, len(steps))  # values nobody reads are returned
        requests.append(
            BufferRequest(i, value.nbytes, IR_DTYPE[value.dtype], first, last, arena, hints)
        )
    return requests


def garbage(rng, dtype, size):
    if dtype == "bool":
        return rng.random(size) < 0.5
    return (rng.standard_normal(size) * 1000).astype(NP_DTYPE[dtype])


def run_in_arenas(rng, n_inputs, steps, values, plan):
    """Run the program with every value in its planned slice; each argument must still hold its
    reference value when read. An output that took over an input in place is written after the
    inputs are read; any other output is scribbled on first, as a kernel free to write its output
    before reading its inputs would."""
    arenas = {key: garbage(rng, key[1], size) for key, size in plan.arena_sizes.items()}

    def slot(i):
        p = plan.placements[i]
        return arenas[(p.arena, p.dtype)][p.offset : p.offset + p.nbytes // ITEMSIZE[p.dtype]]

    for i in range(n_inputs):
        slot(i)[...] = values[i]
    for s, step in enumerate(steps):
        out = slot(n_inputs + s)
        if n_inputs + s not in plan.in_place:
            out[...] = garbage(rng, IR_DTYPE[out.dtype], out.size)
        args = [slot(i) for i in step.args]
        for i, arg in zip(step.args, args, strict=True):
            np.testing.assert_array_equal(arg, values[i], err_msg=f"value {i} clobbered by {s}")
        out[...] = kernel(step.name)(*args)
    return slot


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([8, 64]))
def test_planned_execution_matches_fresh_arrays(seed, alignment_bytes):
    rng = np.random.default_rng(seed)
    n_inputs, steps, values = random_program(rng)
    requests = program_requests(rng, n_inputs, steps, values)
    plan = assign_memory(requests, alignment_bytes)
    slot = run_in_arenas(rng, n_inputs, steps, values, plan)
    for r in requests:
        if r.last_step == len(steps):
            np.testing.assert_array_equal(slot(r.key), values[r.key])


def test_simulated_programs_exercise_in_place_reuse():
    taken = ignored = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        requests = program_requests(rng, *random_program(rng))
        plan = assign_memory(requests)
        taken += len(plan.in_place)
        ignored += sum(1 for r in requests if r.reuse and r.key not in plan.in_place)
    assert taken >= 40
    assert ignored >= 40


# ---------------------------------------------------------------- one arena for every dtype


def _assert_shared_safe(requests, plan):
    """shared=True: buffers of any dtypes of one arena never overlap in bytes while both live
    (but for an in-place takeover)."""
    for i, a in enumerate(requests):
        for b in requests[i + 1 :]:
            pa, pb = plan.placements[a.key], plan.placements[b.key]
            (a0, a1), (b0, b1) = byte_range(pa), byte_range(pb)
            if pa.arena == pb.arena and a0 < b1 and b0 < a1 and lives_overlap(a, b):
                pair = {plan.in_place.get(a.key), plan.in_place.get(b.key)}
                assert a.key in pair or b.key in pair, f"{a} and {b} share bytes while both live"
    for r in requests:
        p = plan.placements[r.key]
        assert p.offset + r.nbytes // ITEMSIZE[r.dtype] <= plan.arena_sizes[(r.arena, r.dtype)]


@settings(max_examples=200, deadline=None)
@given(schedules(), st.sampled_from([8, 64]))
def test_shared_arenas_are_safe_across_dtypes(requests, alignment_bytes):
    plan = assign_memory(requests, alignment_bytes, shared=True)
    _assert_shared_safe(requests, plan)
    assert_hints_followed(requests, plan)
    whole = {}  # an arena's bytes: what its widest view spans
    for (arena, _), nbytes in plan.arena_bytes().items():
        whole[arena] = max(whole.get(arena, 0), nbytes)
    assert plan.peak_bytes == sum(whole.values())
    for (arena, _), bound in lower_bound_bytes(requests).items():
        assert whole[arena] >= bound


def test_a_bfloat16_buffer_reuses_bytes_a_float32_one_freed():
    wide = BufferRequest("wide", 4096, "f32", first_step=0, last_step=1)
    narrow = BufferRequest("narrow", 2048, "bf16", first_step=2, last_step=3)
    apart = assign_memory([wide, narrow])
    shared = assign_memory([wide, narrow], shared=True)
    assert apart.peak_bytes == 4096 + 2048
    assert shared.peak_bytes == 4096
    assert shared.placements["narrow"].offset == 0
    assert shared.arena_sizes == {("scratch", "f32"): 1024, ("scratch", "bf16"): 2048}


def test_a_long_lived_buffer_under_a_larger_short_lived_one_reaches_the_most_live():
    """Largest first put a float64 value held from step 0 to 4 above a larger float32 one that
    dies at step 0, so the two buffers made at step 3 found no gap under it: 3,584 bytes where
    3,072 are live at most (step 3). Placed longest-lived first, the arena is that bound."""
    held = BufferRequest("held", 1024, "f64", first_step=0, last_step=4)
    brief = BufferRequest("brief", 1536, "f32", first_step=0, last_step=0)
    late = BufferRequest("late", 1024, "f64", first_step=3, last_step=4)
    later = BufferRequest("later", 1024, "f64", first_step=3, last_step=3)
    requests = [late, held, brief, later]
    largest_first = memory_plan._place_best_fit([[r] for r in requests], 64)[1]
    plan = assign_memory(requests, 64, shared=True)
    assert largest_first == 3584
    assert plan.peak_bytes == 3072
    _assert_shared_safe(requests, plan)


@settings(max_examples=200, deadline=None)
@given(schedules(), st.sampled_from([8, 64]))
def test_no_arena_ends_above_the_largest_first_placement(requests, alignment_bytes):
    """The other orders are only kept where they end lower."""
    plan = assign_memory(requests, alignment_bytes, shared=True)
    others, memory_plan.OTHER_ORDERS = memory_plan.OTHER_ORDERS, ()
    try:
        largest_first = assign_memory(requests, alignment_bytes, shared=True)
    finally:
        memory_plan.OTHER_ORDERS = others
    assert plan.peak_bytes <= largest_first.peak_bytes
    _assert_shared_safe(requests, plan)
