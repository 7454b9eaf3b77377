"""Building the native kernels: cffi compiles ``kernels.c`` into an extension module on first use,
into a cache keyed by everything that shapes the binary (the source, the declarations, the flags, the
compiler, the Python ABI and the CPU), so a second process loads it in milliseconds.

Why on first use and not at ``pip install``: the kernels are built with ``-march=native`` for the CPU
that runs them (a wheel built elsewhere would not know it), an editable install (how kiln is
developed) runs no build step, and a machine without a compiler still installs the package and runs
the NumPy kernels instead.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from kiln.core import KilnError

HERE = Path(__file__).parent
SOURCE = HERE / "kernels.c"
#: the C functions as cffi sees them (kernels.c defines them)
CDEF = """
void kiln_rmsnorm_fwd(const float *a, const float *x, const float *w, const float *rstd_in, float *res,
                      float *y, float *rstd, int64_t n, int64_t c, float eps, int nt);
void kiln_rmsnorm_bwd(const float *dy, const float *x, const float *rstd, const float *w,
                      const float *drstd, const float *dextra, float *dx, float *dx2, float *dw,
                      int64_t n, int64_t c, int nt);
void kiln_swiglu_fwd(const float *x, float *out, int64_t n, int64_t m, int nt);
void kiln_swiglu_bwd(const float *d, const float *x, float *dx, int64_t n, int64_t m, int nt);
void kiln_silu_mul_fwd(const float *g, const float *u, float *out, int64_t size, int nt);
void kiln_silu_mul_bwd(const float *d, const float *g, const float *u, float *dg, float *du, int64_t size,
                       int nt);
void kiln_adamw(float *p, const float *g, float *m, float *v, int64_t size, float g1, float b1, float g2,
                float b2, float inv_sqrt_bc2, float eps, float lr_bc1, float decay, int use_decay, int nt);
void kiln_embedding_bwd(const float *d, const int64_t *ids, float *dw, int64_t n, int64_t v, int64_t c,
                        int nt);
void kiln_cross_entropy_fwd(const float *z, const int64_t *target, float *loss, float *lse, int64_t rows,
                            int64_t v, int nt);
void kiln_cross_entropy_bwd(const float *z, const int64_t *target, const float *lse, const float *dl,
                            const float *dlse, float *dz, int64_t rows, int64_t v, int nt);
void kiln_silu_fwd(const float *x, float *out, int64_t size, int nt);
void kiln_silu_bwd(const float *d, const float *x, float *dx, int64_t size, int nt);
void kiln_lm_head_softmax(float *z, const int64_t *target, const float *dl, float *lse, float *loss,
                          float *scale, int64_t rows, int64_t v, int nt);
void kiln_qkv_norm_rope_fwd(const float *qkv, const float *qw, const float *kw, const float *cos_t,
                            const float *sin_t, int per_batch, float *out, float *q_rstd, float *k_rstd,
                            int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t h,
                            int interleaved, float eps, int nt);
void kiln_qkv_norm_rope_bwd(const float *dy, const float *qkv, const float *qw, const float *kw,
                            const float *cos_t, const float *sin_t, int per_batch, const float *q_rstd,
                            const float *k_rstd, const float *dq_rstd, const float *dk_rstd, float *dqkv,
                            float *dqw, float *dkw, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                            int64_t h, int interleaved, int nt);
void kiln_flash_fwd(const float *qkv, float *o, float *lse, int64_t b, int64_t t, int64_t hq, int64_t hkv,
                    int64_t d, int causal, int64_t window, const int32_t *seg, float scale, int nt);
void kiln_flash_bwd(const float *dout, const float *qkv, const float *o, const float *lse, const float *dlse,
                    float *dqkv, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, int causal,
                    int64_t window, const int32_t *seg, float scale, int nt);
void kiln_lse_chunk(const float *z, int64_t rows, int64_t cols, int64_t v0, const int64_t *target, float *m,
                    double *s, float *picked, int nt);
void kiln_logits_grad(float *z, int64_t rows, int64_t cols, int64_t v0, const int64_t *target,
                      const float *lse, const float *dl, const float *dlse, int nt);
void kiln_rope(const float *x, const float *cos_t, const float *sin_t, int per_batch, float *out, int64_t b,
               int64_t t, int64_t heads, int64_t hd, int64_t h, int interleaved, float sign, int nt);
void kiln_layernorm_fwd(const float *x, const float *w, const float *bias, float *y, float *mean, float *rstd,
                        int64_t n, int64_t c, float eps, int nt);
void kiln_layernorm_bwd(const float *dy, const float *x, const float *mean, const float *rstd, const float *w,
                        const float *dmean, const float *drstd, float *dx, float *dw, float *db, int64_t n,
                        int64_t c, int nt);
void kiln_gelu_fwd(const float *x, const float *up, float *out, int64_t size, int tanh_form, int nt);
void kiln_gelu_bwd(const float *d, const float *x, float *dx, int64_t size, int tanh_form, int nt);
void kiln_attention_fwd(const float *q, const float *k, const float *v, float *o, float *lse,
                        const int64_t *st, int64_t b, int64_t tq, int64_t tk, int64_t hq, int64_t hkv,
                        int64_t d, int causal, int64_t window, const int32_t *seg, float scale, int nt);
void kiln_attention_bwd(const float *dout, const float *q, const float *k, const float *v, const float *o,
                        const float *lse, const float *dlse, float *dq, float *dk, float *dv,
                        const int64_t *st, int64_t b, int64_t tq, int64_t tk, int64_t hq, int64_t hkv,
                        int64_t d, int causal, int64_t window, const int32_t *seg, float scale, int nt);
"""
#: -ffp-contract=off: no fused multiply-adds, so each expression rounds as its NumPy reference does;
#: -fno-math-errno: sqrtf and friends vectorize (nothing reads errno); -Wno-psabi: without AVX-512, GCC
#: warns that the attention kernels' 16-float vectors would pass differently between functions (they are
#: static and inlined: nothing crosses an ABI)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11",
         "-Wno-psabi")
LINK_FLAGS = ("-fopenmp",)

_lock = threading.Lock()


def cache_dir() -> Path:
    """``$KILN_CPU_CACHE``, else ``$XDG_CACHE_HOME/kiln/cpu``, else ``~/.cache/kiln/cpu``."""
    if os.environ.get("KILN_CPU_CACHE"):
        return Path(os.environ["KILN_CPU_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "cpu"


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), where Linux says them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_key() -> str:
    parts = [SOURCE.read_text(), CDEF, *FLAGS, *LINK_FLAGS, os.environ.get("CC", ""),
             sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "",
             platform.machine(), _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def build(cache: Path | None = None, *, verbose: bool = False) -> ModuleType:
    """The compiled module (``.ffi``, ``.lib``), built into ``cache`` (default :func:`cache_dir`) unless
    it is there already. A build that fails raises :class:`KilnError` with the compiler's message."""
    name = f"_kiln_cpu_{build_key()}"
    folder = cache or cache_dir()
    target = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    with _lock:
        if not target.exists():
            _compile(name, folder, target, verbose)
        return _load(name, target)


def _compile(name: str, folder: Path, target: Path, verbose: bool) -> None:
    try:
        import cffi
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise KilnError(f"the native CPU kernels need cffi: pip install cffi ({e})") from e
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, SOURCE.read_text(), extra_compile_args=list(FLAGS), extra_link_args=list(LINK_FLAGS))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        try:
            built = Path(ffi.compile(tmpdir=tmp, verbose=verbose))
        except Exception as e:  # a missing compiler, a compiler without OpenMP: cffi's CompileError
            raise KilnError(f"could not compile kiln-kernels-cpu's kernels.c ({type(e).__name__}: {e})",
                            hint="install a C compiler with OpenMP (gcc), or set CC; "
                                 "KILN_CPU_KERNELS=0 runs the NumPy kernels without trying") from e
        os.replace(built, target)  # atomic: a process beside this one never sees half a file


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    # libgomp reads this when the module loads it: OpenMP's threads spin for at most ~10k iterations
    # after a kernel before they sleep (the default is 300k: they would take the cores from kiln's own
    # threads and from BLAS in the products that follow)
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module
