"""`make gpu-check`: everything only a CUDA GPU can verify, in one call, in under 10 minutes.

    make gpu-check            # prints one table; writes bench/results/gpu_check.json

The GPU tests (tests/test_gpu.py: device and precision choice, fp16 with its scaler under ddp
and fsdp2, fsdp2 with CPU offload, SyncBatchNorm, deterministic runs), `make bench-gpu`, and a
short NCCL run of each task family (classification, segmentation, detection, language model)
on min(2, GPUs) processes. On a machine without a usable GPU it says why and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {
    "classification": [],
    "segmentation": ["experiment=digits_segmentation"],
    "detection": ["experiment=digits_detection"],
    "language model": ["experiment=lm_char"],
}
SHORT = ["trainer.max_steps=20", "trainer.val_every_steps=10", "logger=none",
         "trainer.progress=false"]  # fmt: skip


def run(name: str, cmd: list[str], timeout: float) -> dict:
    """One check: its command's exit, time and last meaningful line."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        ok, out = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        ok, out = False, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    lines = [x for x in str(out).splitlines() if x.strip()]
    detail = next((x for x in reversed(lines) if "|" in x or "passed" in x or "error" in x),
                  lines[-1] if lines else "")  # fmt: skip
    return {"check": name, "ok": ok, "seconds": time.perf_counter() - start,
            "detail": detail.strip()[:160], "output_tail": "\n".join(lines[-40:])}  # fmt: skip


def checks(nproc: int) -> list[tuple[str, list[str], float]]:
    py, tr = sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={nproc}", str(ROOT / "train.py")]  # fmt: skip
    found = [("GPU tests", [py, "-m", "pytest", "-q", "tests/test_gpu.py",
                            "tests/test_hardware_units.py"], 240.0)]  # fmt: skip
    for family, overrides in FAMILIES.items():
        run_dir = f"run_dir=outputs/gpu_check/{family.replace(' ', '_')}"
        found.append((f"{family}, {nproc} NCCL process(es)", [*tr, *overrides, *SHORT, run_dir],
                      120.0))  # fmt: skip
    found.append(("make bench-gpu", [py, "bench/bench.py", "--device", "cuda"], 300.0))
    return found


def main() -> int:
    from ddp_utils.hardware import probe_cuda

    cuda = probe_cuda()
    if not cuda.usable:
        reason = cuda.why_unusable() if cuda.nvidia_devices else "no NVIDIA GPU on this host"
        print(f"gpu-check: skipped: {reason}")
        return 0
    nproc = min(2, cuda.device_count)
    print(f"gpu-check on {cuda.device_count} x {cuda.name} (compute capability "
          f"{'.'.join(map(str, cuda.capability))}), torch for CUDA {cuda.wheel_cuda}, driver "
          f"for CUDA {cuda.driver_cuda}", flush=True)  # fmt: skip
    rows = []
    for name, cmd, timeout in checks(nproc):
        rows.append(run(name, cmd, timeout))
        print(f"  {'ok  ' if rows[-1]['ok'] else 'FAIL'} {name} ({rows[-1]['seconds']:.0f} s)",
              flush=True)  # fmt: skip
    out = ROOT / "bench" / "results" / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"gpu": cuda.name, "gpus": cuda.device_count, "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    print("\n| check | result | s | last line |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['check']} | {'ok' if r['ok'] else 'FAIL'} | {r['seconds']:.0f} | "
              f"{r['detail'].replace('|', '/')} |")  # fmt: skip
    for r in rows:
        if not r["ok"]:
            print(f"\n--- {r['check']} ---\n{r['output_tail']}")
    print(f"written to {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
