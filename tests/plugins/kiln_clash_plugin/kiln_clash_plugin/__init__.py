"""kiln-clash-plugin: registers an op named ``matmul``, which core already has, to test that core
keeps the name and kiln goes on without this plugin."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_ops(registry):
    from kiln.core import OpDef, TensorType

    registry.register_op(OpDef("clash_identity", ("x",), ("y",), lambda x: x,
                               lambda ctx: [TensorType(ctx.shape(0), ctx.dtype(0))]))
    registry.register_op(OpDef("matmul", ("a", "b"), ("out",), lambda a, b: a @ b,
                               lambda ctx: [TensorType(ctx.shape(0), ctx.dtype(0))]))
