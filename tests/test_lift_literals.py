"""codegen/render/lift.py: every number of a driver body becomes a read of lit_i / lit_f, in
order, and nothing else changes but comments, whose numbers read `n` (one source for every
size): names holding digits and strings stay; the body lifted in one pass equals the body lifted
line by line (the lines a size-generic driver keeps)."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from backplan.codegen.render.lift import _TOKEN, _sizeless, lift_literals


def _line_by_line(body):
    ints, floats = [], []

    def lift(match):
        number = match.group(3)
        if number is None:
            return match.group(0) if match.group(2) is None else _sizeless(match.group(0))
        if any(c in number for c in ".eE"):
            floats.append(float(number))
            return f"lit_f[{len(floats) - 1}]"
        ints.append(int(number))
        return f"lit_i[{len(ints) - 1}]"

    return [_TOKEN.sub(lift, line) for line in body], ints, floats


BODY = [
    "# %v12 = add %v3, %v4 {axis=2} : f32[8, 64]",
    "v12 = scratch_float32[1024:1536].reshape((8, 64))",
    "k_3a9f(v12, np.intp(8), np.intp(64), np.float32(0.015625), np.float64(1e-05))",
    "raise ValueError('label 3 out of range 0..9')  # 10 classes",
    "x2 = v1[0:17, 3:5]  # rows 0..17",
    'print("a #comment-like 42 in a string", 7.5e+3, .25, 3.)',
    "",
    "if bad != -1:",
    "    return 12",
]


def test_lifting_the_body_at_once_equals_lifting_it_line_by_line():
    assert lift_literals(BODY) == _line_by_line(BODY)
    body, ints, floats = lift_literals(BODY)
    assert ints == [1024, 1536, 8, 64, 8, 64, 0, 17, 3, 5, 1, 12]
    assert floats == [0.015625, 1e-05, 7.5e3, 0.25, 3.0]
    assert body[0] == "# %v12 = add %v3, %v4 {axis=n} : f32[n, n]"  # names kept, sizes hidden
    assert body[3] == "raise ValueError('label 3 out of range 0..9')  # n classes"
    assert "k_3a9f(v12" in body[2] and "scratch_float32[lit_i[0]:lit_i[1]]" in body[1]
    assert len(body) == len(BODY)
    assert not any(re.search(r"(?<![\w.\[])\d", line) for line in body[1:3])


def test_a_statement_of_several_lines_and_an_empty_body_keep_their_shape():
    body = ["f(1,\n  2.5)", "g(3)  # 4\n# 5"]
    assert lift_literals(body) == _line_by_line(body)
    assert lift_literals(body)[0] == ["f(lit_i[0],\n  lit_f[0])", "g(lit_i[1])  # n\n# n"]
    assert lift_literals([]) == ([], [], [])
    assert lift_literals([""]) == ([""], [], [])


TOKENS = st.sampled_from(
    [
        "v12",
        "k_3a9f",
        "lit_i",
        "x2_1d",
        "np.intp(",
        "np.float32(",
        ")",
        "(",
        ", ",
        "[",
        ":",
        "]",
        " ",
        "-",
        "+",
        "*",
        ".",
        "=",
        "0",
        "7",
        "128",
        "1024",
        "3.",
        ".25",
        "0.015625",
        "1e-05",
        "7.5e+3",
        "2E4",
        "1.5e3x",
        "12ab",
        "a.5",
        "'label 3'",
        '"a #b 4"',
        "'it\\'s 9'",
        "# 10 classes",
        "#",
        "..",
        "0x1f",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(TOKENS, max_size=12).map("".join), max_size=8))
def test_any_body_lifts_as_the_matching_literal_by_literal_does(body):
    """The split-based lifting against each match replaced in turn (_line_by_line): the same
    lines and the same numbers, in order, whatever the tokens around them."""
    if any("\n" in line for line in body):
        return
    assert lift_literals(body) == _line_by_line(body)
