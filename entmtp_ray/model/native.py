"""The project's C++ kernels, built once per machine as one extension: the fixed-order attention (attention.py), the
row products (products.py) and the decoder step (step.py), each module holding its own source. Owns building, caching
and loading them; knows nothing of what they compute.

The extension is built by torch's extension loader (a C++ compiler, with OpenMP for torch's threads and else on one
thread, and ninja), cached per machine in torch's extensions folder (TORCH_EXTENSIONS_DIR when set), one folder per
source text, build and torch version. `make setup` builds it (`python -m entmtp_ray.model.native`), so a job finds it
built; an installed package builds it on first use, with one log line saying so. Where it cannot be built, `kernel()`
is None, a warning says why once, and the forward keeps torch's own operators.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# the builds tried in turn: with OpenMP (the work split across torch's threads), else without (one thread, the same
# bits: a compiler without OpenMP, as Apple's clang without libomp)
BUILDS = (("", ["-fopenmp"]), ("_serial", []))
# no contraction into FMA behind the source's back: a kernel that wants FMA says so, the same for every row
FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
# torch's loader holds a `lock` file in the build folder while it compiles and waits, with no time limit, for any
# lock it finds; a process killed mid-build (a Ray actor at the end of its job) leaves one behind, and every later
# process on the machine then hung at its first forward. A build takes under a minute: an older lock is a dead build's
STALE_BUILD_LOCK_S = 600.0


class NativeKernel:
    """One C++ kernel: `name`, its source and the functions it exports (None: the source binds its own); `module()`
    builds it on first use (None where it cannot be built). The loader caches builds by name, so the name carries a
    hash of the source: a new text builds anew."""

    def __init__(self, name: str, source: str, functions: list[str] | None, what: str, fallback: str):
        self.name = f"{name}_{hashlib.sha1(source.encode()).hexdigest()[:10]}"
        self.source, self.functions = source, functions
        self.what, self.fallback = what, fallback  # for the log: what it is, and what serves without it
        self.builds = BUILDS  # read when made: a test may set BUILDS first
        self._lock = threading.Lock()
        self._module = None  # the built module; False once a build failed

    def module(self):
        if self._module is None:
            with self._lock:
                if self._module is None:
                    self._module = self._build()
        return self._module or None

    def built(self) -> bool:
        """Whether a build of it lies on this machine (told without importing or building it)."""
        return any(any(build_folder(self.name + suffix).glob("*.so")) for suffix, _ in self.builds)

    def _build(self):
        problems = []
        for suffix, openmp in self.builds:
            folder = build_folder(self.name + suffix)
            fresh = not any(folder.glob("*.so"))
            if fresh:
                log.warning("building the %s once for this machine (under a minute; cached in %s)", self.what, folder)
            try:
                module = self._load(folder, suffix, openmp)
            except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no headers: torch's operators serve
                problems.append(f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300] if str(exc) else ''}")
                continue
            if problems:
                log.warning("the %s was built without OpenMP (%s): it runs on one thread, the same bits more slowly; "
                            "a compiler with OpenMP (e.g. libomp for clang) gives it torch's threads", self.what,
                            problems[0])
            return module
        log.warning("the %s could not be built (%s); %s. Install a C++ compiler and ninja", self.what,
                    "; ".join(problems), self.fallback)
        return False

    def _load(self, folder: Path, suffix: str, openmp: list[str]):
        from torch.utils.cpp_extension import load_inline

        built = import_built(folder, self.name + suffix)
        if built is not None:
            return built
        folder.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(folder / "lock", STALE_BUILD_LOCK_S)
        return load_inline(self.name + suffix, cpp_sources=[self.source], functions=self.functions,
                           extra_cflags=FLAGS + openmp, extra_ldflags=openmp, build_directory=str(folder))


class ThreadSwitch:
    """A kernel switched off on one thread for a block (`off()`), so that a benchmark times it and torch's operators
    side by side; other threads keep it."""

    def __init__(self):
        self._local = threading.local()

    @property
    def is_off(self) -> bool:
        return getattr(self._local, "off", False)

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        previous, self._local.off = self.is_off, True
        try:
            yield
        finally:
            self._local.off = previous


def build_folder(name: str) -> Path:
    """Where kernel `name` is built and cached: torch's extensions folder (TORCH_EXTENSIONS_DIR when set, else
    ~/.cache/torch_extensions), shared by every process of the machine."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{name}-torch{torch.__version__}"


def import_built(folder: Path, name: str):
    """The extension `name` already built in `folder`, imported without torch's loader, or None: not built, or not
    whole yet (a build still linking it). The loader takes the folder's lock even to find a build done, so a process
    killed while holding it (a Ray actor at its job's end) made every later one wait."""
    import importlib.util

    library = folder / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # half-written: the caller waits for the build's lock and loads it through torch's loader
        return None
    return module


def wait_for_build_lock(lock: Path, stale_s: float, poll_s: float = 1.0) -> None:
    """Wait while another process's build holds `lock`; remove it, with a warning, once it is older than `stale_s`
    (its build died), so that torch's loader, which would wait on it forever, builds instead."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


_INCLUDES = """#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif
"""
_BINDINGS = r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fixed_order_attention", &fo::fixed_order_attention);
  m.def("rows_linear", &rp::rows_linear);
  pybind11::class_<step::Model>(m, "Model")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double>())
      .def("forward", &step::Model::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""
_CSRC = Path(__file__).parent / "csrc"  # attention.cpp, products.cpp, step.cpp: the kernels' C++
_KERNEL: NativeKernel | None = None
_kernel_lock = threading.Lock()


def _body(source: str) -> str:
    """A kernel's source without its #include lines, to be compiled inside a namespace."""
    return re.sub(r"^#include[^\n]*\n", "", source, flags=re.M)


def source() -> str:
    """The extension's text: the attention's and the products' code each in a namespace of its own (fo, rp), the
    step's (namespace step) that calls both, then the bindings."""
    def text(name: str) -> str:
        return _body((_CSRC / f"{name}.cpp").read_text())

    return (f"{_INCLUDES}namespace fo {{\n{text('attention')}\n}}\n"
            f"namespace rp {{\n{text('products')}\n}}\n{text('step')}\n{_BINDINGS}")


def extension() -> NativeKernel:
    """The project's one extension, described (its name carries its source's hash), not built."""
    global _KERNEL
    with _kernel_lock:
        if _KERNEL is None:
            _KERNEL = NativeKernel("entmtp_kernels", source(), None,
                                   "C++ kernels (fixed-order attention, row products, decoder step)",
                                   "the forward keeps torch's own operators: SDPA (greedy output equal to AR's up to "
                                   "float ties), oneDNN/MKL/ATen products and the Python layers")
    return _KERNEL


def kernel():
    """The built extension (building it on the first call, once per machine), or None where it cannot be built."""
    return extension().module()


def buildable() -> bool:
    """Whether `kernel()` serves here, told without building it (for choices made before a model loads): built on
    this machine already, or a C++ compiler to build it (torch's loader calls $CXX, else c++)."""
    import shutil

    return extension().built() or shutil.which(os.environ.get("CXX", "c++")) is not None


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    started = time.monotonic()
    built = kernel() is not None
    # not built is no failure: the forward keeps torch's operators (the warning above said why)
    print(f"native kernels built: {built} ({time.monotonic() - started:.1f} s)")
