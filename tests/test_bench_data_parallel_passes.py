"""bench.data_parallel_passes: the processes a pass runs, the lines it keeps, and the package
copy it lays out (backplan/ with every subpackage folder inside it, as installed); and
bench.data_parallel_zero's round order and ratio."""

import os

from backplan.bench.data_parallel_passes import (
    SUBPACKAGES,
    kept_lines,
    lay_out_package,
    pass_commands,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_pass_runs_one_rank_then_each_site_on_two_ranks_then_ddp():
    found = pass_commands("mlp", 8, 5, ["/a", "/b"], ddp=True, zero=True, python="py")
    labels = [label for label, _, _ in found]
    assert labels == ["1 rank", "2 ranks (/a)", "2 ranks (/b)", "DDP 2 ranks"]
    one, a, b, ddp = (argv for _, argv, _ in found)
    assert one[:3] == ["taskset", "-c", "0"] and "--zero" not in one
    assert a[:5] == ["mpiexec", "-n", "2", "-bind-to", "core"] and a[-1] == "--zero"
    assert "backplan.bench.data_parallel_torch" in ddp and "--zero" not in ddp
    envs = [env for _, _, env in found]
    assert all(env["NUMBA_NUM_THREADS"] == "1" for env in envs)
    assert envs[1]["PYTHONPATH"].split(os.pathsep)[0] == "/a"
    assert envs[2]["PYTHONPATH"].split(os.pathsep)[0] == "/b"
    assert "PYTHONPATH" not in envs[0] and "PYTHONPATH" not in envs[3]


def test_without_sites_two_ranks_run_this_installation():
    found = pass_commands("transformer", 5, 3, [], python="py")
    assert [label for label, _, _ in found] == ["1 rank", "2 ranks"]
    assert found[1][1][-6:] == ["--model", "transformer", "--rounds", "5", "--repeats", "3"]


def test_only_the_quoted_lines_are_kept():
    output = "compiling...\nstep 1.0 ms\nCPU per call: 2\nnoise\nZeRO-1 parts 3\n"
    assert kept_lines(output) == ["step 1.0 ms", "CPU per call: 2", "ZeRO-1 parts 3"]


def test_the_package_copy_is_laid_out_as_installed(tmp_path):
    dest = lay_out_package("HEAD", str(tmp_path / "copy"), ROOT)
    assert sorted(os.listdir(dest)) == ["backplan"]  # nothing else left beside the package
    package = os.path.join(dest, "backplan")
    for name in SUBPACKAGES:  # each subpackage folder inside the package, as installed
        assert os.path.isfile(os.path.join(package, name, "__init__.py")), name
    assert os.path.isfile(os.path.join(package, "bench", "data_parallel.py"))
    assert os.path.isfile(os.path.join(package, "__init__.py"))


def test_the_zero_ab_flips_its_order_every_round_and_prints_the_cpu_ratio():
    from backplan.bench.data_parallel_zero import rank_line, round_order

    assert round_order(["plain", "zero"], 0) == ["plain", "zero"]
    assert round_order(["plain", "zero"], 1) == ["zero", "plain"]
    line = rank_line(1, {"plain": (4.0, 20.0), "zero": (3.0, 18.0)})
    assert line.startswith("rank 1: plain cpu 4.000 wall 20.000  zero cpu 3.000")
    assert line.endswith("zero/plain cpu 0.750")


def test_the_copy_moves_every_top_level_folder_the_installation_maps():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    mapped = {d for name, d in dirs.items() if name.count(".") == 1 and "/" not in d}
    assert mapped == set(SUBPACKAGES)
