"""Every internal of backplan the harness reads, named in one place: the rest of bench/ uses the
public API. Each is imported on first use (PEP 562), so importing this module loads nothing;
the harness sets thread counts before backplan and Numba load.

Why each is needed: the GEMM, math and peak-FLOP benchmarks time kernels that have no public
entry; waiting for background driver builds keeps them out of timed rounds; the memory and
budget benchmarks compare the planner's and the accounting's figures with measurements."""

from __future__ import annotations

import importlib

_WHERE = {
    # kernels timed on their own (bench/gemm.py, mathlib.py, peak_flops.py, ln_gelu_fused.py,
    # attention.py's softmax rows)
    "blas": "backplan.codegen.kernels.blas",
    "own_gemm": "backplan.codegen.kernels.gemm",
    "gemm_parallel": "backplan.codegen.kernels.gemm.parallel",
    # the products of the bench models' plans, on the GEMM each calls (model_gemms.py)
    "narrow_gemm_at": "backplan.codegen.kernels.gemm.narrow:narrow_gemm_at",
    "conv_product_shape": "backplan.codegen.kernels.conv:_product_shape",
    "conv_gemm_width": "backplan.codegen.kernels.gemm.choice:conv_gemm_width",
    "ROW_DOTS": "backplan.codegen.kernels.gemm.choice:ROW_DOTS",
    "row_dots": "backplan.codegen.kernels.gemm.row_dots:row_dots",
    "ISA_WIDTH": "backplan.codegen.kernels.gemm:ISA_WIDTH",
    "active_isa": "backplan.codegen.kernels.gemm:active_isa",
    "mathlib": "backplan.codegen.kernels.mathlib",
    "tanh_f32": "backplan.codegen.kernels.mathlib:tanh_f32",
    "tanh_rational_f32": "backplan.codegen.kernels.mathlib:tanh_rational_f32",  # tanh_ulps.py
    "softmax_rows": "backplan.codegen.kernels.rows:softmax_rows",
    "attention_kernels": "backplan.codegen.kernels.attention",  # attention_rates.py
    "attention_variant": "backplan.codegen.kernels.attention:_variant",  # its GEMM path
    "threads": "backplan.codegen.flags:threads",
    # what a process measured it loaded for compiled code (first_call_memory.py)
    "process_memory": "backplan.codegen.build.process_memory",
    "splat": "backplan.codegen.kernels.gemm.kernel:splat",
    # the bfloat16 GEMM's two paths side by side (gemm.py --dtype bf16)
    "gemm_symbols": "backplan.codegen.kernels.gemm.symbols",
    "bf16_gemm_path": "backplan.codegen.kernels.gemm.isa:bf16_gemm_path",
    # bfloat16 GEMM operands widened into float32 copies, as before (half_precision --widened)
    "widen": "backplan.ir.widen",
    # 16-bit widenings in loops of their own, as before (half_precision --unspread)
    "fusion": "backplan.ir.fusion",
    "vector_fma": "backplan.codegen.kernels.gemm.kernel:vector_fma",
    # whether steps size their threads to the free cores (threads.py's report)
    "adapting_threads": "backplan.codegen.run.free_cores:adapting",
    # the library built ahead of time, which cold children load from (compile_cli.py)
    "prebuilt_library": "backplan.codegen.build.prebuilt_library",
    # which compiles are the library's (cold_first_call.py's warning)
    "library_cache": "backplan.codegen.build.library_cache",
    # background driver builds, waited for outside timed rounds
    "driver_builder": "backplan.codegen.build.driver_builder",
    "wait_for_builds": "backplan.codegen.build.driver_builder:wait_for_builds",
    # which executor runs plans
    "current_backend": "backplan.runtime.backend:current_backend",
    "use_backend": "backplan.runtime.backend:use_backend",
    "runner_for": "backplan.runtime.backend:runner_for",
    # the memory contract's own figures, compared with measurements
    "predicted_peak": "backplan.ir.peak:predicted_peak",
    "joint_calls": "backplan.ir.peak:joint_calls",
    "region_calls": "backplan.ir.peak:region_calls",
    "donatable": "backplan.tracer.donate:donatable",  # loading a driver before a first call
    "BackwardMode": "backplan.ir.lowering:BackwardMode",  # and a backward()'s runner
    "gemm_scratch": "backplan.codegen.kernels.gemm.scratch",  # packing buffers kept per process
    "cheapest_within": "backplan.ir.budget:cheapest_within",
    "plan_frontier": "backplan.ir.budget:plan_frontier",
    # a frontier row's parts timed apart: its plan built, then lowered for its peak
    "step_peak_bytes": "backplan.tracer.budget:step_peak_bytes",
    "paused_gc": "backplan.ir.gc_pause:paused_gc",
    # rows simulated where exact against every row built (frontier_rows.py)
    "BudgetPlanner": "backplan.tracer.budget:BudgetPlanner",
    "checked_memory": "backplan.codegen.run.memory_check:checked_memory",  # the checked mode
    "measure": "backplan.codegen.run.memory_check:measure",
    "checking": "backplan.codegen.run.memory_check:checking",  # BACKPLAN_CHECK_MEMORY=1 is on
    "count_held": "backplan.codegen.run.memory_check:count_held",  # a loop's last results
    # the collection after a compiling first call, timed and turned off (compile_garbage.py)
    "compile_garbage": "backplan.codegen.run.compile_garbage",
    "flatten": "backplan.tracer.pytree:flatten",
    # the model's arithmetic per step and where the peak measured once is kept (limits.py);
    # what a budget between frontier rows adds (budget_between_rows.py)
    "node_flops": "backplan.ir.flops:node_flops",
    "cache_dir": "backplan.codegen.build.cache:cache_dir",
    # a plan's driver compiled afresh, linked or calling the library by address
    # (driver_compile.py)
    "driver_tier": "backplan.codegen.build.driver_tier",
    # a plan's address loops compiled one LLVM module each or all in one (one_module.py)
    "loop_batch": "backplan.codegen.build.loop_batch",
    "compiled_plan": "backplan.codegen.run.compiled:CompiledPlan",
    "kernel_cache": "backplan.codegen.build.kernel_cache",  # kernels made per size (batch_sizes)
    "direct_driver": "backplan.codegen.build.direct_driver",  # drivers made per size (batch_sizes)
    "native_calls": "backplan.codegen.build.native_calls",
    "JIT_OPTIONS": "backplan.codegen.flags:JIT_OPTIONS",
    # an address loop's loads and stores, and every kernel module imported as rendering does
    # (loop_llvm_cost.py)
    "address_views": "backplan.codegen.kernels.views",
    "kernel_modules": "backplan.codegen.render.opaque:kernel_modules",
    # the passes a memory_frontier row runs, timed one by one (frontier_parts.py)
    "budget_module": "backplan.tracer.budget",
    "pipeline": "backplan.ir.pipeline",
    "lowering": "backplan.ir.lowering",
    "layout": "backplan.ir.layout",
    "grouping_resume": "backplan.ir.grouping_resume",
    "peak_module": "backplan.ir.peak",
    # the op registry: a reference implementation to check a kernel against (and to sum
    # otherwise: half_ulps.py --floor)
    "get_op": "backplan.ir.registry:get_op",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"backplan.bench.internals has no {name!r}")
    module, _, attribute = where.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


__all__ = sorted(_WHERE)
