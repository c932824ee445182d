"""Everything a lent GPU machine should check, in one call that fits its short lease: the
accelerator test suite (tests/accelerator: the Pallas GPU kernel against the reference, the
engine's greedy tokens against the reference backend and HF transformers), then the benchmarks
(scripts/gpu_bench.py: decode attention, Llama-3-8B-shaped throughput, the HF peer).

    python3 scripts/gpu_session.py --out "$OUT"                  # on the GPU machine
    python3 scripts/gpu_session.py --out "$OUT" --tests 200 -- --section throughput,hf
    python scripts/gpu_session.py --out /tmp/x --dry             # anywhere: the CPU dry run
    python3 scripts/gpu_session.py --out "$OUT" --profile        # the step split alone

Writes OUT/accelerator.xml (JUnit), OUT/gpu_session.jsonl and OUT/gpu_table.md. Arguments after
`--` go to gpu_bench.py. `--profile` runs scripts/gpu_step_profile.py instead (where a decode
step's time goes at C = 1, 32, 256, and every step program lowered for CUDA, OUT/programs):
under 10 minutes, so a 15-minute lease holds it with room for a rerun.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tests(out: Path, limit: float, dry: bool) -> str:
    """The accelerator suite under a time limit; a markdown summary of its JUnit report."""
    xml = out / "accelerator.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           "tests/accelerator", f"--junitxml={xml}", *(["--accelerator-on-cpu"] if dry else [])]
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    lines = ["## Accelerator suite (tests/accelerator)", "",
             f"exit {rc}, {time.perf_counter() - t:.0f} s", "",
             "| test | outcome | s |", "|---|---|---|"]
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = next((child.tag for child in case), "passed")
            message = next((child.get("message", "") for child in case), "")
            lines.append(f"| {case.get('name')} | {outcome} {message[:200]} | "
                         f"{float(case.get('time', 0)):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests", type=float, default=300, metavar="SECONDS",
                        help="the accelerator suite's time limit (0: skip it)")
    parser.add_argument("--dry", action="store_true", help="the CPU dry run (tiny shapes)")
    parser.add_argument("--profile", action="store_true",
                        help="the step profile (scripts/gpu_step_profile.py) alone")
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_step_profile.py"),
                               "--out", str(args.out), *(["--dry"] if args.dry else [])],
                              cwd=ROOT).returncode
    text = run_tests(args.out, args.tests * (4 if args.dry else 1), args.dry) if args.tests else ""
    bench = [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--out", str(args.out),
             *(["--dry"] if args.dry else []), *bench_args]
    subprocess.run(bench, cwd=ROOT)
    bench_md = args.out / "gpu_bench.md"
    text += "\n" + (bench_md.read_text() if bench_md.exists() else "(no benchmark table)\n")
    (args.out / "gpu_table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
