"""An AVX2 target on an AVX-512 host: the GEMM's tile, its size rules and the plan cache follow
the CPU Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), not the host."""

import subprocess
import sys

import pytest
from numba.core import config

from backplan.bench import isa_env
from backplan.codegen.build import cache
from backplan.codegen.kernels.gemm import choice, isa


@pytest.fixture
def fresh_isa():
    isa.active_isa.cache_clear()
    choice.small_products_own.cache_clear()
    cache._cpu.cache_clear()
    yield
    isa.active_isa.cache_clear()
    choice.small_products_own.cache_clear()
    cache._cpu.cache_clear()


def test_features_past_avx2_are_turned_off():
    host = "+avx2,+avx512f,+fma,+avx512bf16,-amx-tile,+avxvnni,+evex512,+f16c,+avx10.1-512"
    out = isa_env.avx2_features(host).split(",")
    assert "+avx2" in out and "+fma" in out and "+f16c" in out
    assert not [f for f in out if f.startswith("+") and f[1:].startswith(isa_env.OFF_PREFIXES)]
    assert len(out) == len(host.split(","))


def test_the_target_not_the_host_picks_the_tile(monkeypatch, fresh_isa):
    monkeypatch.delenv("BACKPLAN_GEMM_ISA", raising=False)
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert isa.active_isa() == "avx2" and isa.vector_width() == 256
    isa.active_isa.cache_clear()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,+avx512f")
    assert isa.active_isa() == "avx512"
    isa.active_isa.cache_clear()
    monkeypatch.setenv("BACKPLAN_GEMM_ISA", "avx2")  # the override still wins
    assert isa.active_isa() == "avx2"


def test_small_product_rules_follow_the_target_cpu(monkeypatch, fresh_isa):
    monkeypatch.setattr(config, "CPU_NAME", "znver3")
    assert isa.target_cpu_name() == "znver3"
    assert not choice.small_products_own()
    choice.small_products_own.cache_clear()
    monkeypatch.setattr(config, "CPU_NAME", "znver5")
    assert choice.small_products_own()


def test_an_emulated_target_has_a_cache_key_of_its_own(monkeypatch, fresh_isa):
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    host = cache.key_parts("graph", "flags")["cpu"]
    cache._cpu.cache_clear()
    monkeypatch.setattr(config, "CPU_NAME", "znver3")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,-avx512f")
    emulated = cache.key_parts("graph", "flags")["cpu"]
    assert emulated != host and emulated.startswith(host)  # the host's part kept
    cache._cpu.cache_clear()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avx512f")
    assert cache.key_parts("graph", "flags")["cpu"] != emulated


def test_the_printed_assignments_name_every_peer():
    done = subprocess.run(
        [sys.executable, "-m", "backplan.bench.isa_env", "avx2"],
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.split("=", 1)[0] for line in done.stdout.splitlines()}
    assert names == {
        "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY",
        "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "XLA_FLAGS",
    }  # fmt: skip
    assert "XLA_FLAGS=" in done.stdout and "--xla_cpu_max_isa=AVX2" in done.stdout
    assert isa_env.isa_env("native") == {}
