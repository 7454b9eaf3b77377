"""kiln-dsl: the Python decorator DSL, graph builder, compiler to IR, diagnostics and model library.

Write a model once as decorated classes (``@module``, ``@block``, ``@model``) whose ``@forward``
builds a graph with ``with graph() as g:``; ``compile_model`` / ``build_bundle`` turn it into kiln
IR. The standard library (``kiln.dsl.stdlib``) registers itself the first time a registry lookup
needs it.
"""

from importlib.metadata import version

from kiln.dsl._builder import GraphBuilder, GraphRef, graph
from kiln.dsl._compiler import (
    build_bundle,
    compile_model,
    compile_model_for_hf,
    config_keys,
    config_type_errors,
    unknown_config_keys,
)
from kiln.dsl._decorators import (
    Activation,
    Gradient,
    ModuleSpec,
    Param,
    PrimitiveSpec,
    abstract,
    backward,
    block,
    extends,
    forward,
    get_block_spec,
    get_model_spec,
    get_module_spec,
    hf_config,
    hf_export,
    hf_mapping,
    is_component,
    kind_of,
    list_registered_blocks,
    list_registered_models,
    list_registered_modules,
    model,
    module,
    param,
    primitive,
    recompute,
    registry,
    save,
)
from kiln.dsl._errors import DSLError
from kiln.dsl._frontend import local_definitions, lookup_component
from kiln.dsl._hf import fuse, hf_tied_to, split, stack_experts, tied_to, transform
from kiln.dsl._types import Array, ArrayType, B, Dim, DimExpr, T, Tensor, TensorAnnotation

__version__ = version("kiln-dsl")

__all__ = [
    "Activation",
    "Array",
    "ArrayType",
    "B",
    "DSLError",
    "Dim",
    "DimExpr",
    "Gradient",
    "GraphBuilder",
    "GraphRef",
    "ModuleSpec",
    "Param",
    "PrimitiveSpec",
    "T",
    "Tensor",
    "TensorAnnotation",
    "__version__",
    "abstract",
    "backward",
    "block",
    "build_bundle",
    "compile_model",
    "compile_model_for_hf",
    "config_keys",
    "config_type_errors",
    "extends",
    "forward",
    "fuse",
    "get_block_spec",
    "get_model_spec",
    "get_module_spec",
    "graph",
    "hf_config",
    "hf_export",
    "hf_mapping",
    "hf_tied_to",
    "is_component",
    "kind_of",
    "list_registered_blocks",
    "list_registered_models",
    "list_registered_modules",
    "local_definitions",
    "lookup_component",
    "model",
    "module",
    "param",
    "primitive",
    "recompute",
    "registry",
    "save",
    "split",
    "stack_experts",
    "tied_to",
    "transform",
    "unknown_config_keys",
]
