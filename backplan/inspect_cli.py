"""`python -m backplan inspect model.bpz`: what an artifact holds, after the same checks load()
makes (nothing in it is unpickled or run): signature, whether it is signed and verified, members
with sizes and hashes, FLOPs per call, saved bytes, peak bytes, and the explain() report of its
plans."""

from __future__ import annotations

import sys

import backplan as bp
from backplan.artifacts.signing import read_key_file


def add_arguments(parser) -> None:
    parser.add_argument("artifact", help="a file written by bp.export or `backplan export`")
    parser.add_argument("--ir", action="store_true", help="also print each plan's IR text")
    parser.add_argument(
        "--key-file",
        help="file holding the key the artifact was signed with: verify its signature "
        "(a file without a valid signature is then refused)",
    )


def run(args) -> int:
    try:
        key = read_key_file(args.key_file) if args.key_file else None
        loaded = bp.load(args.artifact, key=key)
    except bp.ExportError as exc:
        print(f"invalid artifact: {exc}", file=sys.stderr)
        return 1
    manifest = loaded.manifest
    print(f"artifact: {args.artifact}")
    print(
        f"format: {manifest['format']} version {manifest['format_version']}, written by "
        f"backplan {manifest.get('backplan_version', 'unknown')}"
    )
    print(f"kind: {loaded.kind}")
    print(f"signature: {loaded.signature}")
    print(f"authenticity: {loaded.authenticity.value}")
    print(f"members ({sum(loaded.member_sizes.values())} bytes):")
    entries = manifest["members"]
    width = max(len(name) for name in loaded.member_sizes)
    for name, size in sorted(loaded.member_sizes.items()):
        print(f"  {name.ljust(width)}  {size:>10} B  sha256 {entries[name]['sha256'][:16]}")
    flops = ", ".join(f"{role} {count:,}" for role, count in loaded.flops.items())
    print(f"FLOPs per call: {sum(loaded.flops.values()):,} ({flops})")
    report = loaded.explain()
    print(f"saved for backward: {len(report.saved_buffers)} buffer(s), {report.saved_bytes:,} B")
    print(f"peak bytes: {report.peak_bytes:,} (the arrays passed in included, as explain's peak)")
    print()
    print(report)
    if args.ir:
        for role, plan in plan_texts(loaded):
            print(f"\n--- {role} plan\n{plan}")
    return 0


def plan_texts(loaded) -> list[tuple[str, str]]:
    if loaded.kind == "value_and_grad":
        return [("joint", loaded.plan.text())]
    plans = loaded.program.plans
    texts = [("forward", plans.forward.text())]
    if plans.backward is not None:
        texts.append(("backward", plans.backward.text()))
    return texts
