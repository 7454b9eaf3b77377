"""The explicit cast of seed 004 §7.4.4: ``out = cast(x, dtype)``.

Its reference semantics: ``x``'s values rounded to ``dtype`` (round to nearest, ties to even; fp8 and
fp4 saturate to their largest finite value, as a scaled quantizer would clip), held in the type the
backend computes in. The NumPy backend keeps every float tensor in the Program's float type (float32,
or float64 for gradient checks), so a cast to ``fp32`` is the identity there and a cast to a narrower
type rounds the values (``bf16``, ``fp16`` and fp8/fp4 through ml_dtypes). The gradient is cast back:
``d_x = cast(d_out, dtype of x)``, the straight-through rule of every autocast framework (rounding is
flat almost everywhere; its useful gradient is the identity).

Under a precision recipe the cast is an ``fp32`` op (its input is read as it is, never rounded first);
its output holds ``dtype``'s values, which the scheduler records (``Program.rounded`` for ``bf16``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ir._ir import DTYPES, TensorType, is_float
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import CoreOp, core_op, randn

#: the float dtypes a cast may name
FLOAT_DTYPES = tuple(n for n, (_, kind) in DTYPES.items() if kind == "float")
#: IR dtype -> the ml_dtypes type its values are rounded through (fp16 is NumPy's own)
_ML_TYPES = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
             "fp4_e2m1": "float4_e2m1fn"}


def _narrow_type(dtype: str) -> Any:
    if dtype == "fp16":
        return np.float16
    try:
        import ml_dtypes
    except ImportError:
        raise KilnError(f"op 'cast' to {dtype} needs the package 'ml_dtypes', which is not installed",
                        hint="pip install 'kiln-core[bf16]' (or pip install ml-dtypes)") from None
    return getattr(ml_dtypes, _ML_TYPES[dtype])


def cast_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (IR name), in ``x``'s own float type."""
    x = np.asarray(x)
    if dtype == "fp32":
        return x.copy()
    narrow = _narrow_type(dtype)
    info = _finfo(narrow)
    clipped = np.clip(x, -info, info) if dtype.startswith(("fp8", "fp4")) else x
    out: np.ndarray = clipped.astype(narrow).astype(x.dtype)
    return out


def _finfo(narrow: Any) -> float:
    try:
        import ml_dtypes

        return float(ml_dtypes.finfo(narrow).max)  # type: ignore[no-untyped-call]
    except ImportError:
        return float(np.finfo(narrow).max)


def _cast(x: np.ndarray, *, dtype: str) -> np.ndarray:
    return cast_values(x, dtype)


def _cast_infer(ctx: InferContext) -> list[TensorType]:
    if not is_float(ctx.dtype(0)):
        raise ctx.fail(f"input 'x' is {ctx.dtype(0)}; cast converts between float types")
    return [TensorType(ctx.shape(0), str(ctx.attrs["dtype"]))]


def _cast_backward(ctx: BackwardContext) -> list[str | None]:
    return [ctx.emit("cast", ctx.d_out, dtype=ctx.type_of(0).dtype)]


def _samples(rng: np.random.Generator) -> Iterator[Sample]:
    # fp32 is exact on the float64 arrays of the gradient check; a narrower cast's gradient is checked
    # in tests/test_cast.py (the finite difference of a rounding is 0 or a jump)
    yield Sample((randn(rng, 3, 4),), {"dtype": "fp32"})
    yield Sample((randn(rng, 2, 3, 5),), {"dtype": "fp32"})


def _cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    n = float(np.prod(shapes[0]))
    return Cost(flops=n, bytes=n * (4 + DTYPES[str(attrs.get("dtype", "fp32"))][0] / 8))


CORE_OPS: list[CoreOp] = [
    core_op("cast", ("x",), ("out",), _cast, _cast_infer, backward=_cast_backward,
            attrs=(AttrSpec("dtype", "str", choices=FLOAT_DTYPES),), samples=_samples, cost=_cost,
            autocast="fp32",
            doc="x's values rounded to dtype (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp4_e2m1); the "
                "gradient is cast back to x's dtype."),
]

OPS = [c.opdef for c in CORE_OPS]
