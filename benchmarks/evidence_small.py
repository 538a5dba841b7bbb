"""Wall time of Evidence III's stages, one after another, as a user runs them.

Each stage of ``--stages`` (default: all five, in the order they read each other) runs as
``python -m ecp_lm.experiments.evidence --stage S --budget B --out OUT --jobs J`` in its own
process, into a fresh stage folder, and its wall time is taken around that process. The table
and ``--json`` are written again after every stage, so a session that ends mid-way keeps the
stages it finished; run the script again with the same ``--out`` and ``--json`` and it times the
stages not yet timed. A stage whose folder exists but which is not in the JSON was interrupted:
its runs would resume and its time would say nothing, so it is refused (time it again in a fresh
``--out``).

Usage: python benchmarks/evidence_small.py [--budget small] [--jobs 2]
       [--out runs/evidence-small-timed] [--json benchmarks/results/evidence_small_cpu.json]
       [--stages recall,relay,curve,dropout,hybrid]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ecp_lm.experiments.evidence import BUDGETS, STAGES


def minutes(seconds: float) -> str:
    """``1,389 s`` as ``23 min``, ``8,723 s`` as ``2 h 25 min``."""
    m = round(seconds / 60)
    return f"{m // 60} h {m % 60} min" if m >= 60 else f"{m} min"


def table(rows: dict[str, float]) -> str:
    lines = ["| stage | wall time |", "|---|---|"]
    lines += [f"| {stage} | {minutes(s)} ({s:,.0f} s) |" for stage, s in rows.items()]
    if len(rows) > 1:
        total = sum(rows.values())
        lines.append(f"| all {len(rows)} | {minutes(total)} ({total:,.0f} s) |")
    return "\n".join(lines)


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model, family and widest vector extension, as ``cpuinfo`` gives them: runs on
    CPUs with other instruction sets round differently, so a timing says which one it was."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = text.split("\n\n")[0]  # the first processor's block
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in
                                                first.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no avx")
    return (f"{fields.get('model name', platform.machine())}, family "
            f"{fields.get('cpu family', '?')}, model {fields.get('model', '?')}, {vector}")


def run_stage(command: list[str], env: dict[str, str]) -> int:
    """One stage in its own process; its exit code."""
    return subprocess.run(command, env=env).returncode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", choices=BUDGETS, default="small",
                        help="the stages' budget (default small)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--out", type=Path, default=Path("runs/evidence-small-timed"),
                        help="the stage folder, fresh for the timing (default "
                             "runs/evidence-small-timed)")
    parser.add_argument("--json", type=Path,
                        default=Path("benchmarks/results/evidence_small_cpu.json"),
                        help="where the times go, rewritten after every stage")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="comma-separated, run in this order (default: all five)")
    args = parser.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown or not args.stages:
        parser.error(f"--stages {','.join(unknown) or '(none)'}: choose from {','.join(STAGES)}")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done: dict[str, float] = {}
    if args.json.exists():
        previous = json.loads(args.json.read_text())
        if (previous.get("budget"), previous.get("jobs"), previous.get("out")) != (
                args.budget, args.jobs, str(args.out)):
            print(f"error: {args.json} times another run (budget {previous.get('budget')}, "
                  f"jobs {previous.get('jobs')}, out {previous.get('out')}); give another "
                  "--json", file=sys.stderr)
            return 2
        done = previous["seconds"]
    interrupted = [s for s in args.stages
                   if s not in done and (args.out / s / args.budget).exists()]
    if interrupted:
        print(f"error: {args.out / interrupted[0] / args.budget} exists but was not timed to "
              "its end; time the stages again in a fresh --out", file=sys.stderr)
        return 2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for stage in args.stages:
        if stage in done:
            continue
        start = time.perf_counter()
        code = run_stage([sys.executable, "-m", "ecp_lm.experiments.evidence", "--stage", stage,
                          "--budget", args.budget, "--out", str(args.out), "--jobs",
                          str(args.jobs), "--quiet"], env)
        if code:
            print(f"error: the {stage} stage exited with {code}; it is not timed",
                  file=sys.stderr)
            return code
        done[stage] = time.perf_counter() - start
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "budget": args.budget, "jobs": args.jobs, "out": str(args.out), "seconds": done,
            "cpus": os.cpu_count(), "cpu": cpu(),
            "machine": platform.platform()}, indent=2) + "\n")
        print(table(done), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
