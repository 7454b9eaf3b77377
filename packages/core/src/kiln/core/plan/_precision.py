"""Precision recipes: which tensors of a Program hold a lower-precision float type, and where values
are rounded to it.

``fp32`` (the default) computes and keeps every float tensor in the Program's float type. ``bf16``
follows torch's autocast: each op's ``autocast`` trait (:class:`~kiln.core.ops.OpDef`) says where it
computes. A ``lower`` op (a matmul, attention, a grouped GEMM: every ``flop_heavy`` op) reads its
float inputs rounded to bfloat16, accumulates in fp32 and rounds its first output to bfloat16; an
``fp32`` op (norms, softmax, losses) reads its inputs as fp32 and writes fp32; a ``promote`` op (the
rest: elementwise, activations, views) writes bfloat16 when every float input is bfloat16, else fp32
(torch's type promotion). The backward's ops follow the same rules, so a weight's gradient from a
matmul is rounded to bfloat16 before it lands in its fp32 slot, as autocast's ``.grad`` is. A gradient
has its tensor's type, as torch's autograd casts it: the gradient of a forward tensor that is not
bfloat16 counts as fp32 in a ``promote`` step even when its values are bfloat16 (the scheduler's
``_float32_reads``), so the product of a bf16 op's gradient of an fp32 tensor is fp32, as in torch. Weights
(the master copy), gradients, optimizer state and the Program's inputs stay fp32. So do an op's
float32 statistics (``OpDef.statistics``: a log-sum-exp, a norm's rstd, a loss, their cotangents),
wherever it computes: never rounded on read (:func:`rounded_reads`) nor written as bf16, as torch keeps
SDPA's logsumexp and autocast's ``cross_entropy`` in float32.

A tensor whose values are bfloat16 is stored as bfloat16 (2 bytes an element, so the planned peak
drops) unless its slot is a fp32 one (a gradient): :attr:`Program.rounded` names them all.

Per-op overrides (seed 004 §7.4, "Recipe Override"): ``@precision`` and ``@dtype`` on a tensor of the
forward graph override the recipe for the op that computes it (:func:`precision_overrides`). Under the
``fp32`` recipe an op outside any override runs as torch does outside autocast: it writes bfloat16
only when all its float inputs are bfloat16 (``promote``), so one op annotated ``compute="bf16"``
runs in bfloat16 and the ops after it return to fp32 at the first fp32 operand or ``fp32`` op. The
backward ops a backward rule derives from an overridden op get its compute (autograd runs an op's
backward in the precision its forward ran in), not its ``output``, which names the forward's tensor:
the derived backward records each one's forward op (``metadata["derived_from"]``), and
``Program.computes`` lists them by their first output, as the forward's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kiln.core._errors import KilnError

#: the recipes a Program may follow
RECIPES = ("fp32", "bf16")
#: the ``autocast`` classes of an op (``OpDef.autocast``; "" derives one from ``flop_heavy``)
LOWER, FP32, PROMOTE = "lower", "fp32", "promote"


@attrs.frozen
class Precision:
    """A precision recipe: ``name`` (``fp32`` or ``bf16``) and ``low``, the NumPy name of the float
    type its low-precision tensors hold (``"bfloat16"``), or None (``fp32``: none). Weights,
    gradients and optimizer state keep the Program's float type (``master``) under every recipe."""

    name: str = "fp32"
    low: str | None = None
    master: str = "float32"

    @property
    def lowers(self) -> bool:
        """Whether any tensor is kept or rounded in the low-precision type."""
        return self.low is not None

    @staticmethod
    def op_class(opdef: Any) -> str:
        """``lower``, ``fp32`` or ``promote``: where the recipe computes ``opdef``."""
        declared = str(getattr(opdef, "autocast", "") or "")
        return declared or (LOWER if getattr(opdef, "flop_heavy", False) else PROMOTE)

    def default_class(self, opdef: Any) -> str:
        """Where the recipe computes ``opdef`` when no annotation overrides it: its autocast class
        under ``bf16``; ``promote`` under ``fp32`` (torch outside autocast: an op computes in the type
        of its inputs)."""
        return PROMOTE if self.name == "fp32" else self.op_class(opdef)

    def compute_class(self, opdef: Any, override: Override | None = None) -> str:
        """``lower``, ``fp32`` or ``promote``: where ``opdef`` computes, ``override`` applied."""
        if override is not None and override.compute is not None:
            return LOWER if override.compute == "bf16" else FP32
        if override is not None and override.region is not None:
            return self.op_class(opdef) if override.region == "bf16" else FP32
        return self.default_class(opdef)

    def rounds_inputs(self, opdef: Any, override: Override | None = None) -> bool:
        """Whether ``opdef`` reads its float inputs rounded to the low type (a ``lower`` op; its
        :attr:`~kiln.core.ops.OpDef.statistics` excepted, :func:`rounded_reads`)."""
        return self.compute_class(opdef, override) == LOWER

    def rounded_outputs(self, opdef: Any, inputs: Sequence[bool | None],
                        outputs: Sequence[bool], override: Override | None = None) -> tuple[bool, ...]:
        """Per output of ``opdef``: whether its values are rounded to the low type. ``inputs``: per
        input, None (absent or not float), True (its values are low) or False (fp32); ``outputs``: per
        output, whether it is float. ``override``: the op's ``@precision``/``@dtype`` (its ``output``
        decides the first output). A backward step passes the gradient of a tensor that is not low as
        False whatever its values (torch gives a gradient its tensor's dtype)."""
        if not self.lowers:
            return tuple(False for _ in outputs)
        out = self._rounded(self.compute_class(opdef, override), inputs, outputs)
        # a float32 statistic (a log-sum-exp, a norm's rstd, a loss) stays float32 wherever the op computes
        out = tuple(r and not s for r, s in zip(out, statistic_flags(opdef, len(outputs), True), strict=True))
        if override is not None and override.output is not None and outputs and outputs[0]:
            out = (override.output == "bf16", *out[1:])
        return out

    @staticmethod
    def _rounded(kind: str, inputs: Sequence[bool | None], outputs: Sequence[bool]) -> tuple[bool, ...]:
        if kind == LOWER:
            return tuple(f and i == 0 for i, f in enumerate(outputs))
        floats = [x for x in inputs if x is not None]
        low = kind == PROMOTE and bool(floats) and all(floats)
        return tuple(f and low for f in outputs)


FP32_RECIPE = Precision()


def statistic_flags(opdef: Any, n: int, outputs: bool = False) -> tuple[bool, ...]:
    """Per position of a step's ``n`` inputs (or ``outputs``): whether it is one of ``opdef``'s float32
    statistics (:attr:`~kiln.core.ops.OpDef.statistics`), which no recipe rounds."""
    flags = getattr(opdef, "statistic_flags", None)
    return tuple(flags(n, outputs)) if flags is not None else (False,) * n


def rounded_reads(opdef: Any, n: int, lower: bool) -> tuple[bool, ...]:
    """Per input of a step of ``opdef`` with ``n`` inputs: whether a backend reads it rounded to the low
    type, ``lower`` saying whether the step computes there (its float inputs rounded first, as autocast
    casts an op's inputs). A float32 statistic the op reads (a log-sum-exp, a norm's rstd, a loss's
    cotangent) is read as it is stored: torch's SDPA backward reads its float32 logsumexp, not a bf16
    one. The one rule of the NumPy emulation and of kiln.cuda's host and generic bf16 paths."""
    if not lower:
        return (False,) * n
    return tuple(not s for s in statistic_flags(opdef, n))

#: the IR dtypes a per-op override may name on the NumPy emulation
OVERRIDE_DTYPES = ("fp32", "bf16")
#: ``@precision(policy=...)``: (compute, output), seed 004 §7.4.2
POLICIES = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"),
            "fp8_hybrid": ("fp8_e4m3", "bf16"), "fp8_pure": ("fp8_e4m3", "fp8_e4m3"),
            "fp4": ("fp4_e2m1", "bf16")}


@attrs.frozen
class Override:
    """A per-op override of the precision recipe: the op computes in ``compute`` (``"bf16"``: its float
    inputs rounded to bfloat16, fp32 accumulation; ``"fp32"``: its inputs read as fp32) and writes its
    first output as ``output``; None keeps what the recipe says. ``where``: the annotated tensor."""

    compute: str | None = None
    output: str | None = None
    where: str = ""
    #: a module's ``@precision``: its ops compute as the recipe of that name would compute them
    #: (``"bf16"``: autocast's classes; ``"fp32"``: every op in fp32)
    region: str | None = None

    @property
    def low(self) -> bool:
        """Whether the override asks for the low (bfloat16) type anywhere."""
        return "bf16" in (self.compute, self.output, self.region)


def precision_overrides(modules: Iterable[Any]) -> dict[tuple[str, str], Override]:
    """``(module name, tensor name) -> Override`` from the ``@precision`` and ``@dtype`` annotations on
    the forward tensors of ``modules`` (IR Modules). Precedence (seed 004 §7.4): ``@dtype`` (binding:
    the output type) over ``@precision(policy=...)`` over ``@precision(compute=, output=)`` over a
    ``@precision`` of the module (key ``"@"`` + the inlined submodule's prefix, ``"@"`` for the whole
    module: a region whose ops compute as that recipe would) over the recipe. A dtype the NumPy
    emulation cannot give (fp16, fp8, fp4, ints) or a non-fp32 accumulation is a KilnError naming
    the tensor."""
    out: dict[tuple[str, str], Override] = {}
    for m in modules:
        anns: dict[str, list[Any]] = {}
        for a in getattr(m, "annotations", ()):
            if a.on == "tensor" and a.kind in ("precision", "dtype"):
                anns.setdefault(a.target, []).append(a)
            if a.on == "module" and a.kind == "precision":
                where = f"module {m.name}" + (f" ({a.target})" if a.target else "")
                args = dict(a.args)
                region = POLICIES[str(args["policy"])][0] if args.get("policy") else args.get("compute")
                if region not in OVERRIDE_DTYPES or args.get("output") or args.get("accumulate",
                                                                                   "fp32") != "fp32":
                    raise KilnError(f"@precision{args} on {where}: a module's @precision names where its ops "
                                    f"compute, {' or '.join(OVERRIDE_DTYPES)}",
                                    hint="@precision(policy='bf16') or @precision(compute='fp32'); output= "
                                         "goes on a tensor")
                out[(m.name, "@" + a.target)] = Override(where=where, region=region)
        for tensor, found in anns.items():
            where = f"tensor {tensor!r} of {m.name}"
            compute = output = None
            for a in found:
                args = dict(a.args)
                if a.kind == "precision":
                    if args.get("accumulate", "fp32") != "fp32":
                        raise KilnError(f"@precision(accumulate={args['accumulate']!r}) on {where}: kiln "
                                        "accumulates in fp32", hint="drop accumulate= (fp32 is the default)")
                    compute, output = args.get("compute", compute), args.get("output", output)
                    if args.get("policy") is not None:
                        compute, output = POLICIES[str(args["policy"])]
            for a in found:
                if a.kind == "dtype":
                    output = str(a.args["type"])
            for what, value in (("compute", compute), ("output", output)):
                if value is not None and value not in OVERRIDE_DTYPES:
                    raise KilnError(f"@precision/@dtype on {where} asks for {what} {value!r}; the precision "
                                    f"recipes compute in {' and '.join(OVERRIDE_DTYPES)} only",
                                    hint="fp16, fp8 and fp4 compute are not implemented yet: use fp32, bf16")
            if compute is not None or output is not None:
                out[(m.name, tensor)] = Override(compute, output, where)
    return out


def with_overrides(recipe: Precision, overrides: Mapping[Any, Override], dtype: str,
                   cast: bool = False) -> Precision:
    """``recipe``, given a low type when an override (or, ``cast``, an explicit cast) asks for
    bfloat16 under ``fp32``."""
    if recipe.lowers or not (cast or any(o.low for o in overrides.values())):
        return recipe
    first = next((o for o in overrides.values() if o.low), Override(where="a cast to bf16"))
    if dtype != "float32":
        raise KilnError(f"@precision/@dtype on {first.where} asks for bf16, which goes with float32 master "
                        f"weights; dtype={dtype!r} does not", hint="use dtype='float32'")
    require_ml_dtypes("bf16")
    return attrs.evolve(recipe, low="bfloat16")


def precision_recipe(value: Any = "fp32", dtype: str = "float32") -> Precision:
    """The :class:`Precision` ``value`` names (``"fp32"``, ``"bf16"``; None is ``fp32``; a Precision
    passes through), for Programs whose float type is ``dtype``. ``bf16`` needs the package
    ``ml_dtypes`` (``pip install 'kiln-core[bf16]'``) and float32 master weights."""
    if value is None:
        value = "fp32"
    if isinstance(value, Precision):
        recipe = value
    elif value == "fp32":
        recipe = attrs.evolve(FP32_RECIPE, master=dtype)
    elif value == "bf16":
        recipe = Precision("bf16", "bfloat16")
    else:
        raise KilnError(f"precision={value!r} is not valid; expected one of "
                        f"{', '.join(map(repr, RECIPES))}")
    if recipe.lowers:
        if dtype != recipe.master:
            raise KilnError(f"precision={recipe.name!r} keeps {recipe.master} master weights; "
                            f"dtype={dtype!r} does not go with it",
                            hint=f"use dtype={recipe.master!r}, or precision='fp32'")
        require_ml_dtypes(recipe.name)
    return recipe


def require_ml_dtypes(what: str = "bf16") -> Any:
    """``ml_dtypes`` (it gives NumPy its bfloat16 type), or a KilnError naming the package to install."""
    try:
        import ml_dtypes
    except ImportError:
        raise KilnError(f"the {what} precision recipe needs the package 'ml_dtypes', which is not installed",
                        hint="pip install 'kiln-core[bf16]' (or pip install ml-dtypes)") from None
    return ml_dtypes
