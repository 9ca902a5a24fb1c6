"""The suite's order under xdist (tests/long_first.py): the files of the longest tests first,
each file's tests in their own order, the other files after them as pytest collected them."""

from pathlib import Path

from long_first import LONG_FILES, long_first


def test_long_files_come_first_in_their_order_and_each_file_keeps_its_tests_order():
    items = [
        "test_a.py::one",
        f"{LONG_FILES[1]}::first",
        "test_b.py::two",
        f"{LONG_FILES[0]}::only",
        f"{LONG_FILES[1]}::second",
        "test_a.py::three",
    ]
    ordered = long_first(items, file_of=lambda item: item.split("::")[0])
    assert ordered == [
        f"{LONG_FILES[0]}::only",
        f"{LONG_FILES[1]}::first",
        f"{LONG_FILES[1]}::second",
        "test_a.py::one",
        "test_b.py::two",
        "test_a.py::three",
    ]


def test_every_listed_file_is_a_test_file_of_the_suite_named_once():
    here = Path(__file__).parent
    assert len(set(LONG_FILES)) == len(LONG_FILES)
    assert [name for name in LONG_FILES if not (here / name).is_file()] == []
