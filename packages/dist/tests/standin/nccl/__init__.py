"""A stand-in for nccl4py (``nccl``) on a machine without GPUs: the few names kiln-dist's ``nccl``
communicator uses, its collectives run by MPI on host memory (see ``core``). Tests put the folder
above it on ``PYTHONPATH``."""
