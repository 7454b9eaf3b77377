"""kiln-kernels-cuda: the CUDA backend, NVRTC-compiled kernels loaded and launched through cuda-python."""

from importlib.metadata import version

from kiln.cuda._backend import CudaBackend
from kiln.cuda._emulate import EmulatedCuda, EmulatedDevice
from kiln.cuda._nvrtc import compile_cubin
from kiln.cuda._ops import (
    THREADS,
    DeviceArray,
    Scratch,
    check_id_errors,
    cross_entropy,
    embedding,
    embedding_backward,
    fused_lm_head_loss,
    fused_lm_head_loss_backward,
    matmul,
    norm_into,
    np_dtype,
    strided_copy,
    vocab_local_ids,
)
from kiln.cuda._plugin import cuda_available, unavailable_reason

__version__ = version("kiln-kernels-cuda")

#: ``DeviceArray`` (a tensor's view of device memory; ``upload``/``download`` copy host arrays to and from
#: it, ``np_dtype`` maps its dtype to NumPy's), ``Scratch`` (a step's workspace, as its launch functions
#: take temporaries), ``norm_into`` (sums of squares into a device scalar) and ``THREADS`` (the
#: block size of the elementwise kernels): what other packages' kernels for ``cuda`` build on (kiln-dist's);
#: and the launch functions those compose (``matmul``, ``embedding``/``embedding_backward``,
#: ``cross_entropy``, ``fused_lm_head_loss``/``_backward``, ``strided_copy``: the kernel table's ``out=``
#: convention on ``DeviceArray`` views, float32); ``vocab_local_ids`` maps token ids into a rank's rows
#: of a split vocabulary, its bad ids raised by ``check_id_errors`` after a synchronisation
__all__ = ["THREADS", "CudaBackend", "DeviceArray", "EmulatedCuda", "EmulatedDevice", "Scratch",
           "__version__", "check_id_errors", "compile_cubin", "cross_entropy", "cuda_available", "embedding",
           "embedding_backward", "fused_lm_head_loss", "fused_lm_head_loss_backward", "matmul", "norm_into",
           "np_dtype", "strided_copy", "unavailable_reason", "vocab_local_ids"]
