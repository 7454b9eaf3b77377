"""The annotations of seed 004 §7 (memory, hooks, precision, fusion, sharding, debug, training).

Write one after ``@`` on what it annotates, as the seed does, or as a class decorator for a module::

    from kiln.dsl.annotations import checkpoint, frozen, hook, memory, shard

    weight = Param(Tensor["O", "C"]) @ shard("column") @ frozen
    h = g.matmul(x, "weight", transpose="NT") @ memory("recompute") @ hook("AfterMLPUpProjection")

``assert_`` is the seed's ``@assert`` (``assert`` is a Python keyword). ``GraphBuilder.annotate(ref,
...)`` does the same as ``@`` for tensors held in a tuple. See docs/dsl.md, "Annotations".
"""

from kiln.dsl._annotations import ANNOTATIONS, AnnotationFactory, AnnotationValue

memory = AnnotationFactory("memory")
checkpoint = AnnotationFactory("checkpoint")
lifetime = AnnotationFactory("lifetime")
hook = AnnotationFactory("hook")
adapter = AnnotationFactory("adapter")
probe = AnnotationFactory("probe")
dtype = AnnotationFactory("dtype")
precision = AnnotationFactory("precision")
scaling = AnnotationFactory("scaling")
fuse = AnnotationFactory("fuse")
nofuse = AnnotationFactory("nofuse")
kernel = AnnotationFactory("kernel")
shard = AnnotationFactory("shard")
partition = AnnotationFactory("partition")
comm = AnnotationFactory("comm")
assert_ = AnnotationFactory("assert")
profile = AnnotationFactory("profile")
trace = AnnotationFactory("trace")
frozen = AnnotationFactory("frozen")
trainable = AnnotationFactory("trainable")
gradient = AnnotationFactory("gradient")

#: every annotation factory by its seed name (``"assert"`` for ``assert_``)
BY_NAME = {
    f.kind: f
    for f in (
        memory,
        checkpoint,
        lifetime,
        hook,
        adapter,
        probe,
        dtype,
        precision,
        scaling,
        fuse,
        nofuse,
        kernel,
        shard,
        partition,
        comm,
        assert_,
        profile,
        trace,
        frozen,
        trainable,
        gradient,
    )
}
assert set(BY_NAME) == set(ANNOTATIONS)

__all__ = [
    "BY_NAME",
    "AnnotationFactory",
    "AnnotationValue",
    "adapter",
    "assert_",
    "checkpoint",
    "comm",
    "dtype",
    "frozen",
    "fuse",
    "gradient",
    "hook",
    "kernel",
    "lifetime",
    "memory",
    "nofuse",
    "partition",
    "precision",
    "probe",
    "profile",
    "scaling",
    "shard",
    "trace",
    "trainable",
]
