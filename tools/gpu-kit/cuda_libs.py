#!/usr/bin/env python3
"""Find the CUDA libraries the GPU kit needs and report their versions (tools/gpu-kit/run).

What it is: the search for libcudart.so.13, libcublas.so.13, libcublasLt.so.13 and
libnccl.so.2 on a machine the kit did not build on, in this order: the directories of
$MPUSIM_CUDA_LIB_DIRS (colon-separated), the CUDA toolkit (/usr/local/cuda/lib64 and
/usr/local/cuda-*/lib64, targets/x86_64-linux/lib), the dynamic loader's cache
(ldconfig -p), then the `nvidia` wheels of every Python on PATH (PyTorch's bundled CUDA:
site-packages/nvidia/*/lib and nvidia/cu13/lib). Then it loads each library found with
ctypes and asks it its version: cudaRuntimeGetVersion, cudaDriverGetVersion (0 without a
driver), cublasGetProperty, ncclGetVersion, and reads the GPUs with cudaGetDeviceCount and
cudaGetDeviceProperties.
What it is not: a loader setting; run puts the printed directories on LD_LIBRARY_PATH of
mpusim's processes only (never of Python's).

Usage: cuda_libs.py          prints "dirs=DIR:DIR", then "name = value" lines
Exit code: 0 when all four libraries were found, 1 otherwise (the lines say which is missing).
"""
import ctypes
import glob
import os
import subprocess
import sys

LIBRARIES = ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2"]


def candidate_dirs():
    dirs = [d for d in os.environ.get("MPUSIM_CUDA_LIB_DIRS", "").split(":") if d]
    for root in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        dirs += [f"{root}/lib64", f"{root}/targets/x86_64-linux/lib"]
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        for line in cache.splitlines():
            if "=>" in line and any(lib in line for lib in LIBRARIES):
                dirs.append(os.path.dirname(line.split("=>")[1].strip()))
    except OSError:
        pass
    # The nvidia wheels of each python3 on PATH (PyTorch's CUDA libraries).
    seen = set()
    for path_dir in os.environ.get("PATH", "").split(":"):
        exe = os.path.join(path_dir, "python3")
        if not os.access(exe, os.X_OK) or os.path.realpath(exe) in seen:
            continue
        seen.add(os.path.realpath(exe))
        try:
            out = subprocess.run([exe, "-c", "import site, sys; print('\\n'.join("
                                  "site.getsitepackages() + [site.getusersitepackages()]))"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for site_dir in out.split():
            dirs += sorted(glob.glob(os.path.join(site_dir, "nvidia", "*", "lib")))
    unique = []
    for d in dirs:
        if d not in unique and os.path.isdir(d):
            unique.append(d)
    return unique


def main():
    found = {}
    for d in candidate_dirs():
        for lib in LIBRARIES:
            if lib not in found and os.path.exists(os.path.join(d, lib)):
                found[lib] = os.path.join(d, lib)
    dirs = []
    for lib in LIBRARIES:
        if lib in found and os.path.dirname(found[lib]) not in dirs:
            dirs.append(os.path.dirname(found[lib]))
    print("dirs=" + ":".join(dirs))
    for lib in LIBRARIES:
        print(f"{lib} = {found.get(lib, 'NOT FOUND')}")
    missing = [lib for lib in LIBRARIES if lib not in found]

    def version(lib, call):
        try:
            return call(ctypes.CDLL(found[lib], mode=ctypes.RTLD_GLOBAL))
        except (OSError, AttributeError, KeyError) as e:
            return f"unknown ({e})"

    def cudart(handle):
        runtime, driver = ctypes.c_int(), ctypes.c_int()
        handle.cudaRuntimeGetVersion(ctypes.byref(runtime))
        handle.cudaDriverGetVersion(ctypes.byref(driver))
        count = ctypes.c_int()
        error = handle.cudaGetDeviceCount(ctypes.byref(count))
        print(f"cuda_driver_api = {driver.value // 1000}.{driver.value % 1000 // 10}"
              + (" (no driver)" if driver.value == 0 else ""))
        print(f"cuda_devices = {count.value if error == 0 else 0}"
              + (f" (cudaGetDeviceCount error {error})" if error else ""))
        if error == 0:
            for i in range(count.value):
                props = ctypes.create_string_buffer(4096)  # cudaDeviceProp; name first
                if handle.cudaGetDeviceProperties(props, i) == 0:
                    print(f"cuda_device_{i} = {props.value.decode(errors='replace')}")
        return f"{runtime.value // 1000}.{runtime.value % 1000 // 10}"

    def cublas(handle):
        parts = []
        for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            handle.cublasGetProperty(prop, ctypes.byref(value))
            parts.append(str(value.value))
        return ".".join(parts)

    def nccl(handle):
        value = ctypes.c_int()
        handle.ncclGetVersion(ctypes.byref(value))
        v = value.value
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"

    if "libcudart.so.13" in found:
        print(f"cuda_runtime = {version('libcudart.so.13', cudart)}")
    if "libcublas.so.13" in found:
        print(f"cublas = {version('libcublas.so.13', cublas)}")
    if "libnccl.so.2" in found:
        print(f"nccl = {version('libnccl.so.2', nccl)}")
    if missing:
        print(f"missing = {' '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
