"""``ir.verify`` checks that every annotation of a hand-written Module names something it defines."""

from __future__ import annotations

import pytest

from kiln.core import IRError
from kiln.core.ir import Annotation, Graph, Module, Op, ParamSpec, TensorDecl, diagnostics, verify


def mlp(*annotations: Annotation) -> Module:
    return Module(
        "Mlp", kind="block", config={"C": 4},
        params=[ParamSpec("w", ["C", "C"], "fp32"), ParamSpec("inner.w", ["C", "C"], "fp32")],
        forward=Graph("Mlp", inputs=[TensorDecl("x", ["N", "C"], "fp32")],
                      params=[TensorDecl("w", ["C", "C"], "fp32"), TensorDecl("inner.w", ["C", "C"], "fp32")],
                      ops=[Op("matmul", ["x", "w"], ["h"], {"transpose": "NT"}),
                           Op("matmul", ["h", "inner.w"], ["inner.y"], {"transpose": "NT"})],
                      outputs=[TensorDecl("inner.y", ["N", "C"], "fp32")]),
        annotations=annotations)


def test_annotations_on_defined_names_verify() -> None:
    verify(mlp(Annotation("kernel", "tensor", "h", {"name": "reference"}),
               Annotation("frozen", "param", "w"), Annotation("checkpoint", "module", ""),
               Annotation("trace", "module", "inner"), Annotation("dtype", "tensor", "x", {"type": "bf16"})))


@pytest.mark.parametrize(("ann", "words"), [
    (Annotation("kernel", "tensor", "hh", {"name": "reference"}), "@kernel on tensor 'hh': not a tensor of"),
    (Annotation("frozen", "param", "v"), "@frozen on param 'v': not a parameter of Mlp"),
    (Annotation("trace", "module", "outer"), "@trace on module 'outer'"),
    (Annotation("precision", "param", "h", {"policy": "fp32"}), "@precision on param 'h'"),
])
def test_an_annotation_on_an_unknown_name_is_e002(ann: Annotation, words: str) -> None:
    (d,) = [d for d in diagnostics(mlp(ann)) if d.is_error]
    assert d.code == "E002" and words in d.message
    with pytest.raises(IRError, match="failed verification with 1 error"):
        verify(mlp(ann))
