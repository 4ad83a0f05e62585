"""CUDA C++ kernels built at run time and launched through the CUDA driver (ctypes).

Triton has no bulk copies into shared memory on an mbarrier, nor control over how a
persistent kernel's blocks hand data to each other, which ``layer_chain.cu`` needs. The
source is compiled for the device's architecture when the engine starts (about a second), by
nvcc where the CUDA toolkit is installed, else by NVRTC from the ``nvidia-cuda-nvrtc`` wheel
with ``cuda_bf16.h`` from ``nvidia-cuda-runtime`` (wheels that pip's CUDA builds of torch
pull in). The cubin is loaded into torch's primary context, so the kernel runs on torch's
streams and inside its CUDA graphs.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaBuildError(RuntimeError):
    """No compiler could build the kernel (no toolkit and no NVRTC wheel, or a compile error)."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (loading, configuring or launching a kernel)."""


@cache
def cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library, for the calls torch does not expose."""
    return ctypes.CDLL("libcuda.so.1")


def check_cuda(status: int, call: str) -> None:
    """Raise if a driver call returned anything but CUDA_SUCCESS."""
    if status != 0:
        raise CudaDriverError(f"{call} failed with CUresult {status}")


def nvidia_wheel_file(pattern: str) -> Path:
    """The first file matching ``pattern`` under the ``nvidia`` wheels' package folders."""
    try:
        import nvidia  # a namespace package: one folder per installed NVIDIA wheel
    except ImportError as e:
        raise FileNotFoundError(f"no NVIDIA wheels installed, so no {pattern}") from e
    for base in nvidia.__path__:
        found = sorted(Path(base).glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"no NVIDIA wheel holds {pattern}")


def nvrtc_available() -> bool:
    """Whether the NVRTC library and the bf16 header are installed as NVIDIA wheels."""
    try:
        nvidia_wheel_file("*/lib/libnvrtc.so*")
        nvidia_wheel_file("*/include/cuda_bf16.h")
    except FileNotFoundError:
        return False
    return True


def available_compiler() -> str | None:
    """"nvcc", "nvrtc" or None: what ``build_cubin`` would use here."""
    if shutil.which("nvcc") is not None:
        return "nvcc"
    return "nvrtc" if nvrtc_available() else None


def build_cubin(source: Path, defines: dict[str, str], arch: str = "sm_90",
                compiler: str | None = None) -> tuple[bytes, list[str]]:
    """``source`` compiled for ``arch`` by ``compiler`` (default: ``available_compiler()``):
    the cubin and ptxas's resource lines (registers, shared memory, spills)."""
    compiler = compiler or available_compiler()
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    if compiler == "nvcc":
        with tempfile.TemporaryDirectory() as build:
            cubin = Path(build) / "kernel.cubin"
            built = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-lineinfo",
                                    "--resource-usage", *flags, "-o", str(cubin), str(source)],
                                   capture_output=True, text=True)
            if built.returncode != 0:
                raise CudaBuildError(f"nvcc could not compile {source.name}:\n{built.stderr}")
            binary, log = cubin.read_bytes(), built.stderr
    elif compiler == "nvrtc":
        binary, log = nvrtc_cubin(source, [
            f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo", "--ptxas-options=-v",
            f"-I{nvidia_wheel_file('*/include/cuda_bf16.h').parent}", *flags])
    else:
        raise CudaBuildError("no CUDA compiler: neither nvcc on the PATH nor the "
                             "nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels")
    return binary, [line.strip() for line in log.splitlines() if "Used" in line or "spill" in line]


def nvrtc_cubin(source: Path, options: list[str]) -> tuple[bytes, str]:
    """``source`` compiled by NVRTC: the cubin and the compiler's log."""
    # NVRTC opens its builtins library by name when it compiles; the wheel's folder is not on
    # the loader's path, so load it first (the loader then finds it by its soname).
    ctypes.CDLL(str(nvidia_wheel_file("*/lib/libnvrtc-builtins.so*")), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(nvidia_wheel_file("*/lib/libnvrtc.so*")))
    program = ctypes.c_void_p()

    def check(status: int, call: str) -> None:
        if status != 0:
            raise CudaBuildError(f"{call} failed with nvrtcResult {status}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.read_text().encode(),
                                   source.name.encode(), 0, None, None), "nvrtcCreateProgram")
    encoded = [o.encode() for o in options]
    status = nvrtc.nvrtcCompileProgram(program, len(encoded),
                                       (ctypes.c_char_p * len(encoded))(*encoded))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    if status != 0:
        raise CudaBuildError(f"NVRTC could not compile {source.name}:\n{log.value.decode()}")
    check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
    binary = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetCUBIN(program, binary), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return binary.raw, log.value.decode()


class CudaKernel:
    """A kernel of a loaded cubin, launched on torch's current stream (and so capturable).

    The module lives in ``device``'s primary context (torch's), which loads and launches make
    current, so an engine on another GPU than the current one launches on its own."""

    def __init__(self, cubin: bytes, name: str, threads: int, shared_bytes: int,
                 device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # makes the primary context current here
            cu = cuda_driver()
            self._module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
            self._image = ctypes.create_string_buffer(cubin, len(cubin))
            check_cuda(cu.cuModuleLoadData(ctypes.byref(self._module), self._image),
                       "cuModuleLoadData")
            check_cuda(cu.cuModuleGetFunction(ctypes.byref(self.function), self._module,
                                              name.encode()), "cuModuleGetFunction")
            check_cuda(cu.cuFuncSetAttribute(self.function,
                                             CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             shared_bytes), "cuFuncSetAttribute")
        self.threads, self.shared_bytes = threads, shared_bytes

    def blocks_per_sm(self) -> int:
        """How many blocks of this kernel one SM holds at once."""
        blocks = ctypes.c_int()
        check_cuda(cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), self.function, self.threads, ctypes.c_size_t(self.shared_bytes)),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return blocks.value

    def launch(self, grid: int, args: list) -> None:
        """Launch ``grid`` blocks with ``args`` (ints are pointers; ctypes values as they are)."""
        values = [ctypes.c_void_p(a) if isinstance(a, int) else a for a in args]
        pointers = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        with torch.cuda.device(self.device):
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            check_cuda(cuda_driver().cuLaunchKernel(self.function, grid, 1, 1, self.threads,
                                                    1, 1, self.shared_bytes, stream, pointers,
                                                    None), "cuLaunchKernel")
