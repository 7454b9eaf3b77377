"""Type annotations of the DSL: ``Tensor[...]``, ``Array[...]`` and the dimension objects."""

from __future__ import annotations

from typing import Any

import attrs

from kiln.core.ir import DTYPES, DimExpr, Sym

__all__ = ["DEFAULT_DTYPE", "Array", "ArrayType", "B", "Dim", "DimExpr", "T", "Tensor", "TensorAnnotation"]

#: dtype of a ``Tensor[...]`` that names none (seed 003 §3.2).
DEFAULT_DTYPE = "bf16"

#: ``Dim("d_model")`` is the symbol ``d_model``; arithmetic on dims builds kiln ``DimExpr`` trees.
Dim = Sym
B = Sym("B")  #: the batch dimension
T = Sym("T")  #: the sequence dimension

DimArg = str | int | DimExpr


@attrs.frozen
class TensorAnnotation:
    """``Tensor[dims..., dtype]``: a symbolic shape (strings, ints or dims) and a dtype."""

    dims: tuple[DimArg, ...]
    dtype: str = DEFAULT_DTYPE
    optional: bool = False
    explicit_dtype: bool = False

    def __or__(self, other: Any) -> TensorAnnotation:
        if other is None:
            return attrs.evolve(self, optional=True)
        return NotImplemented

    def __ror__(self, other: Any) -> TensorAnnotation:
        return self.__or__(other)

    def __repr__(self) -> str:
        text = f"Tensor[{', '.join(map(repr, (*self.dims, self.dtype)))}]"
        return text + " | None" if self.optional else text


@attrs.frozen
class ArrayType:
    """``Array[count, Element]``: ``count`` stacked copies of a block (by name or class)."""

    count: DimArg
    element: Any

    @property
    def element_name(self) -> str:
        return self.element if isinstance(self.element, str) else self.element.__name__


def _is_dim(value: Any) -> bool:
    return isinstance(value, (str, DimExpr)) or (isinstance(value, int) and not isinstance(value, bool))


class Tensor:
    """``Tensor["B", "T", "C"]``, ``Tensor["B", "T", 4096, "fp32"]``: the dtype may come last."""

    def __class_getitem__(cls, item: Any) -> TensorAnnotation:
        items = item if isinstance(item, tuple) else (item,)
        dtype, explicit = DEFAULT_DTYPE, False
        if items and isinstance(items[-1], str) and items[-1] in DTYPES:
            dtype, explicit, items = items[-1], True, items[:-1]
        bad = [d for d in items if not _is_dim(d)]
        if bad:
            raise TypeError(
                f"Tensor[...] takes dimensions (str, int, Dim) and a dtype last; found {bad[0]!r}"
            )
        return TensorAnnotation(tuple(items), dtype, explicit_dtype=explicit)


class Array:
    """``Array["n_layers", "DenseTransformerBlock"]``: a stack of blocks."""

    def __class_getitem__(cls, item: Any) -> ArrayType:
        if not (isinstance(item, tuple) and len(item) == 2 and _is_dim(item[0])):
            raise TypeError(f"Array[count, Block] takes a count and a block, found {item!r}")
        return ArrayType(item[0], item[1])
