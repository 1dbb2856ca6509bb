"""What this host's accelerators can do, and the choices made from it.

Each choice (the device a rank trains on, ``precision=auto``, cuDNN's and TF32's settings,
determinism) is a function of a ``Cuda`` record, so that the decisions are tested on any
machine with the capabilities faked; ``probe_cuda`` and ``apply_backend_flags`` are the thin
parts that talk to the driver and to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp_utils.config import ConfigError

INSTALL_DOC = "docs/install.md"


@dataclass(frozen=True)
class Cuda:
    """What torch and the host say about NVIDIA GPUs, for one process."""

    usable: bool = False  # torch.cuda.is_available()
    device_count: int = 0  # the devices this process sees (CUDA_VISIBLE_DEVICES applied)
    nvidia_devices: int = 0  # the GPUs the host's driver shows, usable by torch or not
    hidden: bool = False  # CUDA_VISIBLE_DEVICES="" or -1: the user chose no GPU
    driver_cuda: str | None = None  # the newest CUDA the installed driver runs
    wheel_cuda: str | None = None  # the CUDA torch was built for (None: a CPU-only build)
    capability: tuple[int, int] | None = None  # of this process's first visible device
    name: str = ""  # that device's name

    @property
    def native_bf16(self) -> bool:
        """bf16 tensor cores: compute capability 8.0 (Ampere) and later."""
        return self.capability is not None and self.capability[0] >= 8

    def why_unusable(self) -> str:
        """Why torch cannot use the host's GPUs, with the versions that decide it."""
        if self.wheel_cuda is None:
            return f"this torch ({torch.__version__}) is a CPU-only build"
        if self.driver_cuda is None:
            return (f"torch is built for CUDA {self.wheel_cuda} but the NVIDIA driver library "
                    "(libcuda.so.1) cannot be loaded")  # fmt: skip
        if version_tuple(self.driver_cuda) < version_tuple(self.wheel_cuda)[:1]:
            return (f"torch is built for CUDA {self.wheel_cuda} but the driver runs CUDA "
                    f"{self.driver_cuda} at most (a newer driver, or a torch built for CUDA "
                    f"{self.driver_cuda})")  # fmt: skip
        return (f"torch is built for CUDA {self.wheel_cuda} and the driver runs CUDA "
                f"{self.driver_cuda}, yet torch.cuda.is_available() is false (a missing "
                "library or device permission: see `python -m ddp_utils.doctor`)")  # fmt: skip


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def driver_cuda_version() -> str | None:
    """The newest CUDA version the installed driver supports (cuDriverGetVersion), without
    initialising CUDA; None where there is no driver library."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def host_nvidia_devices(root: Path = Path("/")) -> int:
    """The NVIDIA GPUs the host's kernel driver shows (whether torch can use them or not)."""
    gpus = root / "proc/driver/nvidia/gpus"
    with contextlib.suppress(OSError):
        if gpus.is_dir():
            return sum(1 for _ in gpus.iterdir())
    with contextlib.suppress(OSError):
        return sum(1 for p in (root / "dev").iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    return 0


def probe_cuda(env: Mapping[str, str] | None = None, index: int = 0) -> Cuda:
    """This host's record; ``capability`` and ``name`` are those of device ``index``."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    usable = torch.cuda.is_available()
    count = torch.cuda.device_count() if usable else 0
    index = index if index < count else 0
    capability = torch.cuda.get_device_capability(index) if count else None
    return Cuda(
        usable=usable,
        device_count=count,
        nvidia_devices=host_nvidia_devices(),
        hidden=visible is not None and visible.strip() in ("", "-1"),
        driver_cuda=driver_cuda_version(),
        wheel_cuda=torch.version.cuda,
        capability=capability,
        name=torch.cuda.get_device_name(index) if count else "",
    )


def choose_device(
    want: str, local_rank: int, local_world_size: int, per_task_devices: bool, cuda: Cuda
) -> torch.device:
    """``trainer.device`` (auto | cpu | cuda) for this rank.

    ``per_task_devices``: the launcher gave each process devices of its own (SLURM's
    ``--gpus-per-task`` / ``--gpu-bind``): this rank uses the first it sees, whatever its
    local rank. Otherwise (torchrun) every rank of a node sees the same devices and takes
    ``cuda:LOCAL_RANK``.
    """
    if want == "cpu":
        return torch.device("cpu")
    if not cuda.usable:
        if want == "cuda":
            reason = cuda.why_unusable() if cuda.nvidia_devices else "no NVIDIA GPU is visible"
            raise ConfigError(f"trainer.device=cuda, but {reason}. Use trainer.device=cpu, or "
                              f"see {INSTALL_DOC}.")  # fmt: skip
        if cuda.nvidia_devices and not cuda.hidden:
            raise ConfigError(
                f"trainer.device=auto: this host has {cuda.nvidia_devices} NVIDIA GPU(s) that "
                f"torch cannot use: {cuda.why_unusable()}. Install torch for the driver's CUDA "
                f"(make install TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ, "
                f"{INSTALL_DOC}), or train on the CPU on purpose with trainer.device=cpu."
            )
        return torch.device("cpu")
    if per_task_devices and cuda.device_count < local_world_size:
        return torch.device("cuda", local_rank % cuda.device_count)
    if local_world_size > cuda.device_count:
        raise ConfigError(
            f"{local_world_size} processes on this node but only {cuda.device_count} GPU(s) "
            f"visible: launch with --nproc_per_node={cuda.device_count}, or set "
            "trainer.device=cpu."
        )
    return torch.device("cuda", local_rank)


def auto_precision(device_type: str, cuda: Cuda, amx: bool, bf16_on_cpu: bool) -> str:
    """``trainer.precision=auto``: on CUDA bf16 where the GPU has bf16 units, else fp16 with a
    gradient scaler (as torchvision's references' ``--amp`` on a V100 or T4); on a CPU bf16
    only with AMX tiles and for a model measured faster there (docs/speed.md), else 32."""
    if device_type == "cuda":
        return "bf16" if cuda.native_bf16 else "fp16"
    return "bf16" if device_type == "cpu" and amx and bf16_on_cpu else "32"


def check_precision(precision: str, device_type: str, cuda: Cuda) -> None:
    """An explicit bf16 on a GPU without bf16 units would be emulated, several times slower
    than fp16: refused, naming the device and the fix."""
    if precision == "bf16" and device_type == "cuda" and not cuda.native_bf16:
        cc = ".".join(map(str, cuda.capability or ()))
        raise ConfigError(
            f"trainer.precision=bf16 on {cuda.name or 'this GPU'} (compute capability {cc}): "
            "it has no bf16 units (Ampere, 8.0, and later do) and would emulate them slowly. "
            "Use trainer.precision=auto (fp16 with a gradient scaler here) or fp16."
        )


@dataclass(frozen=True)
class BackendFlags:
    """torch's global switches for a run (what torchvision's references set)."""

    cudnn_benchmark: bool  # autotune convolution algorithms per input shape
    tf32: bool  # float32 matmuls and convolutions on TF32 tensor cores (Ampere and later)
    deterministic: bool  # torch.use_deterministic_algorithms and cuDNN's deterministic mode


def backend_flags(
    device_type: str, deterministic: bool, fixed_input_shapes: bool = True
) -> BackendFlags:
    """On CUDA: TF32 on, and cuDNN autotuning where the inputs keep one shape (a task whose
    images vary in size, detection's, would autotune again for every new shape, as
    torchvision's detection reference avoids), unless ``trainer.deterministic``, which turns
    both off. On a CPU neither exists."""
    fast = device_type == "cuda" and not deterministic
    return BackendFlags(cudnn_benchmark=fast and fixed_input_shapes, tf32=fast,
                        deterministic=deterministic)  # fmt: skip


def apply_backend_flags(flags: BackendFlags, device_type: str) -> None:
    """Set ``flags`` in torch. Only CUDA's switches: a CPU run's numbers stay unchanged."""
    if device_type == "cuda":
        # Only torch's fp32_precision switches, never the legacy allow_tf32 ones: reading or
        # setting a legacy one after a new one raises ("mix of the legacy and new APIs").
        torch.backends.cudnn.benchmark = flags.cudnn_benchmark
        torch.backends.cudnn.deterministic = flags.deterministic
        precision = "tf32" if flags.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
        if flags.deterministic:
            # cuBLAS needs a fixed workspace for reproducible results (read at its first use).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op without a deterministic kernel (upsampling's backward on CUDA) warns
    # once, naming itself, instead of stopping a run.
    torch.use_deterministic_algorithms(flags.deterministic, warn_only=True)
