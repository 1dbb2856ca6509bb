"""`python bench/gpu_check.py` (or `make gpu-check`): everything only a CUDA GPU can verify,
in one call, finished within 10 minutes by construction.

    python bench/gpu_check.py        # one table; bench/results/gpu_check.json

The checks are tests/test_gpu.py's (one row each: what it proves is in docs/gpus.md), the
CUDA start-up and hardware units, and `make bench-gpu`. Every training run starts fresh in a
new temporary folder. The whole call has one deadline: each part gets what is left of it,
a part still running then is stopped and fails, and a part never reached fails too. A host
whose NVIDIA GPUs torch cannot use fails, naming why; a host without any says so and exits 0.
Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEADLINE_S = 570.0  # the whole call, start-up and table included, under 10 minutes
BENCH_S = 150.0  # held back from the tests for bench-gpu
WORKERS = 4  # tests run at once: each trains a small model on the GPU(s) for seconds
TESTS = ["tests/test_cuda_startup_units.py", "tests/test_hardware_units.py", "tests/test_gpu.py"]


@dataclass
class Row:
    check: str
    result: str  # ok | FAIL | skipped
    seconds: float
    detail: str


class Clock:
    """What is left of the call's deadline."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self, reserve: float = 0.0) -> float:
        return max(0.0, self.end - time.monotonic() - reserve)


def run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> tuple[int | None, str, float]:
    """(exit code, or None when stopped at ``timeout``; its output; its seconds). The command
    runs in a session of its own, so that at the deadline its whole tree stops (a test's
    torchrun and workers with it), not only its first process."""
    start = time.monotonic()
    if timeout <= 0:
        return None, "not started: no time left", 0.0
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        log.seek(0)
        out = log.read()
    if code is None:
        out += f"\nstopped at the deadline after {timeout:.0f} s"
    return code, out, time.monotonic() - start


# pytest -v's result lines: "path::name PASSED [ 10%]", or under xdist
# "[gw1] [ 10%] PASSED path::name"
VERBOSE = (re.compile(r"^(\S+?)::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"),
           re.compile(r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+?)::(\S+)\s*$"))  # fmt: skip
RESULTS = {"PASSED": "ok", "FAILED": "FAIL", "ERROR": "FAIL", "SKIPPED": "skipped",
           "XFAIL": "ok", "XPASS": "FAIL"}  # fmt: skip


def test_rows(junit: Path, output: str, wanted: list[str], stopped: bool) -> list[Row]:
    """One row per test: from pytest's JUnit XML when it finished, else from its verbose
    lines; a test it never reached (stopped at the deadline) fails as not run."""
    rows: dict[str, Row] = {}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            stem = (case.get("classname") or "").rsplit(".", 1)[-1]
            name = f"{stem}::{case.get('name')}"
            seconds = float(case.get("time") or 0)
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                rows[name] = Row(name, "FAIL", seconds, first_line(bad.get("message") or ""))
            elif skip is not None:
                rows[name] = Row(name, "skipped", seconds, first_line(skip.get("message") or ""))
            else:
                rows[name] = Row(name, "ok", seconds, "")
    else:
        for line in output.splitlines():
            if m := VERBOSE[0].match(line):
                path, test, result = m.group(1), m.group(2), m.group(3)
            elif m := VERBOSE[1].search(line):
                result, path, test = m.group(1), m.group(2), m.group(3)
            else:
                continue
            name = f"{Path(path).stem}::{test}"
            rows[name] = Row(name, RESULTS[result], 0.0, "")
    for name in wanted:
        if name not in rows:
            why = "not run: the deadline came first" if stopped else "not run"
            rows[name] = Row(name, "FAIL", 0.0, why)
    return list(rows.values())


def first_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[0][:160] if lines else ""


def collected(tests: list[str]) -> list[str]:
    """The test ids pytest will run, as ``file_stem::name``."""
    code, out, _ = run([sys.executable, "-m", "pytest", "--collect-only", "-q", *tests], 120)
    names = []
    for line in out.splitlines():
        if "::" in line and not line.startswith(" "):
            path, _, name = line.partition("::")
            names.append(f"{Path(path).stem}::{name}")
    return names


def run_tests(
    clock: Clock,
    work: Path,
    tests: list[str] = TESTS,
    reserve: float = BENCH_S,
    workers: int = WORKERS,
) -> list[Row]:
    """The tests, one row each, in what is left of the deadline less ``reserve``; ``workers``
    at a time (pytest-xdist, test by test: each run is small beside a GPU's memory)."""
    wanted = collected(tests)
    junit = work / "junit.xml"
    spread = ["-n", str(workers), "--dist", "load"] if workers > 1 else []
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--basetemp={work}/t",
           f"--junitxml={junit}", *spread, *tests]  # fmt: skip
    code, out, _ = run(cmd, clock.left(reserve))
    rows = test_rows(junit, out, wanted, stopped=code is None)
    if code not in (0, 1) and not any(r.result == "FAIL" for r in rows):
        rows.append(Row("pytest", "FAIL", 0.0, first_line(out[-2000:])))
    return rows


def run_bench(clock: Clock) -> Row:
    code, out, seconds = run([sys.executable, "bench/bench.py", "--device", "cuda"], clock.left())
    lines = [x for x in out.splitlines() if x.strip()]
    detail = next((x for x in reversed(lines) if "|" in x), lines[-1] if lines else "")
    return Row("make bench-gpu", "ok" if code == 0 else "FAIL", seconds, detail.strip()[:160])


def describe(cuda) -> str:
    return (f"{cuda.device_count} x {cuda.name} (compute capability "
            f"{'.'.join(map(str, cuda.capability or ()))}), torch built for CUDA "
            f"{cuda.wheel_cuda}, driver for CUDA {cuda.driver_cuda}")  # fmt: skip


def report(rows: list[Row], header: str, out: Path) -> int:
    """Print the table, write the JSON; 0 when nothing failed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    ok = bool(rows) and all(r.result != "FAIL" for r in rows)
    out.write_text(json.dumps({"host": header, "passed": ok,
                               "rows": [asdict(r) for r in rows]}, indent=2) + "\n")  # fmt: skip
    print(f"\ngpu-check on {header}\n\n| check | result | s | detail |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.check} | {r.result} | {r.seconds:.0f} | {r.detail.replace('|', '/')} |")
    failed = sum(r.result == "FAIL" for r in rows)
    print(f"\n{'passed' if ok else f'FAILED: {failed} check(s)'}; written to {out}")
    return 0 if ok else 1


def main(probe=None, deadline_s: float = DEADLINE_S, out: Path | None = None) -> int:
    from ddp_utils.hardware import probe_cuda

    clock = Clock(deadline_s)
    cuda = (probe or probe_cuda)()
    out = out or ROOT / "bench" / "results" / "gpu_check.json"
    if not cuda.usable:
        if not cuda.nvidia_devices or cuda.hidden:
            print("gpu-check: skipped: no NVIDIA GPU on this host")
            return 0
        why = f"{cuda.nvidia_devices} NVIDIA GPU(s) that torch cannot use: {cuda.why_unusable()}"
        return report([Row("torch sees the GPUs", "FAIL", 0.0, why)], "this host", out)
    print(f"gpu-check on {describe(cuda)}; at most {deadline_s:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as work:
        rows = run_tests(clock, Path(work))
        rows.append(run_bench(clock))
    return report(rows, describe(cuda), out)


if __name__ == "__main__":
    sys.exit(main())
