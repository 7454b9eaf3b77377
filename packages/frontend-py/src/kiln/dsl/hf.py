"""HuggingFace weight-mapping specs (also exported from ``kiln.dsl``)."""

from kiln.dsl._hf import HFMapping, fuse, hf_tied_to, split, stack_experts, tied_to, transform

__all__ = ["HFMapping", "fuse", "hf_tied_to", "split", "stack_experts", "tied_to", "transform"]
