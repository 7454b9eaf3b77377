"""The kernels kiln launches: for each, its source file and the type of each parameter.

This table is the launch code's side of the argument contract: :func:`pack` builds the
``cuLaunchKernel`` argument array from it (one pointer to each value), and the tests check it against
the parameter layout NVRTC gave each CUBIN and against the emulator's ``sizeof`` of each parameter.
Type codes: ``p`` a device pointer (8 bytes, 0 for null), ``i`` int32, ``q`` int64, ``f`` float32.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import attrs

from kiln.core import KilnError

KERNEL_DIR = Path(__file__).parent / "kernels"

_CTYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}


@attrs.frozen
class KernelSpec:
    name: str
    file: str
    params: str
    #: False for a kernel only a GPU runs (tensor-core instructions): compiled and layout-checked only
    emulated: bool = True

    def layout(self) -> list[tuple[int, int]]:
        """(offset, size) of each parameter in the kernel's parameter block (C alignment rules)."""
        out, offset = [], 0
        for code in self.params:
            size = ctypes.sizeof(_CTYPES[code])
            offset = -(-offset // size) * size
            out.append((offset, size))
            offset += size
        return out


def _specs(file: str, **kernels: str) -> dict[str, KernelSpec]:
    return {name: KernelSpec(name, file, params.replace(" ", ""), "_tc" not in name)
            for name, params in kernels.items()}


def _attention_mma() -> dict[str, KernelSpec]:
    """The tiled bf16 attention kernels: tensor cores (``tc``) and their SIMT twins, head dims 64 and 128."""
    out = {}
    for variant in ("tc", "twin"):
        for hd in (64, 128):
            out |= _specs("attention_mma.cu", **{
                f"flash_attention_{variant}{hd}_bf16": "pppp iiiiii ff i",
                f"flash_attention_backward_dq_{variant}{hd}_bf16": "pppppppp iiiiii ff i",
                f"flash_attention_backward_dkv_{variant}{hd}_bf16": "pppppp iiiiii ff i",
                # the bf16 recipe's: a float32 qkv rounded on load; d_qkv written as float32
                f"flash_attention_{variant}{hd}_bf16_f": "pppp iiiiii ff i",
                **{f"flash_attention_backward_dq_{variant}{hd}_bf16_{qg}": "pppppppp iiiiii ff i"
                   for qg in ("hf", "ff")},
                **{f"flash_attention_backward_dkv_{variant}{hd}_bf16_{qg}": "pppppp iiiiii ff i"
                   for qg in ("hf", "ff")}})
    return out


SPECS: dict[str, KernelSpec] = {
    **_specs("elementwise.cu", fill_f32="pfq", scale_f32="ppfq", add_f32="pppqq", mul_f32="pppqq",
             silu_f32="ppq", silu_backward_f32="pppq", relu_f32="ppq", relu_backward_f32="pppq",
             gelu_f32="ppqi", gelu_backward_f32="pppqi", swiglu_f32="ppqq", swiglu_backward_f32="pppqq",
             swiglu_rp_bf16="ppqq", swiglu_backward_rp_bf16="pppqq",
             silu_mul_f32="pppq", silu_mul_backward_f32="pppppq", softcap_f32="pqf",
             softcap_backward_f32="ppqf", cast_f32_bf16="ppq", cast_bf16_f32="ppq", dropout_f32="ppqqqqf"),
    **_specs("norms.cu", rmsnorm_f32="ppppif", fused_residual_rmsnorm_f32="ppppppif",
             rmsnorm_backward_dx_f32="pppppppi", rmsnorm_backward_dw_f32="ppppqi",
             layernorm_f32="ppppppif", layernorm_backward_dx_f32="ppppppppi",
             layernorm_backward_dw_f32="ppppppqi"),
    **_specs("softmax.cu", softmax_f32="ppiq", softmax_backward_f32="pppiq"),
    **_specs("loss.cu", cross_entropy_f32="ppppii", cross_entropy_backward_f32="ppppppii",
             lm_head_loss_grad_f32="pppppii", lm_head_loss_grad_bf16="ppppppii",
             lm_head_lse_chunk_f32="pppppiii", lm_head_lse_chunk_bf16="pppppiii",
             lm_head_lse_done_f32="pppppiii", lm_head_grad_chunk_f32="ppppiii",
             lm_head_grad_chunk_bf16="pppppiii"),
    **_specs("embedding.cu", embedding_f32="pppqi", embedding_backward_f32="pppqiiii"),
    **_specs("rope.cu", rope_f32="ppppiiiiiifii", rope_freqs_f32="ppqif"),
    **_specs("optimizer.cu", adamw_f32="ppppqffffffff", adamw_multi_f32="ppiffffffff", sgd_f32="pppqfffiiff",
             sumsq_partial_f32="pqp", sqrt_sum_f32="pqp", clip_scale_f32="p",
             adamw_multi_dev_f32="ppipiff fff"),
    **_specs("matmul.cu", matmul_f32="ppppiiiiiqqqff", matmul_bf16="ppppiiiiiqqqff",
             **{f"matmul_bf16_{v}": "ppppiiiiiqqqff"
                for v in ("hhh", "hff", "hfh", "fhf", "fhh", "fff", "ffh")}),
    **_specs("moe.cu", moe_sigmoid_f32="ppq", moe_sigmoid_backward_f32="pppq", moe_topk_f32="pppiiii",
             moe_topk_backward_f32="ppppiiii", moe_route_f32="pppii", moe_gather_rows_f32="pppqii",
             moe_invert_f32="ppq", moe_combine_rows_f32="ppppqii", moe_unpermute_dy_f32="ppppqii",
             moe_unpermute_dw_f32="ppppii", grouped_gemm_f32="ppppiiiii", grouped_gemm_dw_f32="ppppii",
             moe_load_stats_f32="pppppiii", moe_load_stats_backward_f32="pppii",
             moe_aux_loss_f32="ppppppiifii", moe_aux_loss_backward_f32="pppppiifii",
             moe_router_aux_f32="pppif", moe_router_aux_backward_f32="pppqif"),
    **_specs("attention.cu", flash_attention_f32="pppp iiiiii ff i",
             flash_attention_backward_dq_f32="pppppppp iiiiii ff i",
             flash_attention_backward_dkv_f32="pppppp iiiiii ff i",
             qkv_norm_rope_f32="pppppppp iiiiii ff i", qkv_norm_rope_backward_dx_f32="ppppppppppp iiiiii f i",
             qkv_norm_rope_backward_dw_f32="pppppppppp iiiiiii f i",
             qk_norm_rp_bf16="pppppp iiii f", qk_norm_backward_rp_bf16="ppppppppp iiii",
             qk_norm_backward_dw_rp_bf16="pppppp iiiii",
             attention_f32="pppppp iiiiiii ff i", attention_backward_dq_f32="pppppppppp iiiiiii ff i",
             attention_backward_dkv_f32="ppppppppp iiiiiii ff i"),
    **_specs("mamba.cu", mamba_conv1d_f32="pppppqiiii", mamba_conv1d_state_f32="pppqii",
             mamba_conv1d_grad_f32="ppppppqiiii", mamba_conv1d_backward_dx_f32="pppppqiii",
             mamba_conv1d_backward_dw_f32="pppppiiii",
             mamba_scan_f32="ppppppppppp iiiiii",
             mamba_scan_backward_f32="ppppppppppp ppppppppppp iiiiii",
             mamba_scan_chunked_f32="pppppppppppp iiiiii",
             mamba_scan_chunked_backward_f32="pppppppppp pppppppppp iiiiiii",
             mamba_sum_batch_f32="ppiq", mamba_sum_group_f32="ppiiiiii"),
    **_attention_mma(),
}

# issue 17: the recompute variants of the norms, the remaining pointwise ops, reductions and layout copies
SPECS |= {
    **_specs("elementwise.cu", rmsnorm_apply_saved_f32="ppppqi",
             fused_residual_rmsnorm_apply_saved_f32="ppppppqi", div_f32="pppqq", exp_f32="ppq",
             reciprocal_f32="ppq", sigmoid_f32="ppq", sigmoid_backward_f32="pppq", relu2_f32="ppq",
             relu2_backward_f32="pppq", geglu_f32="pppqi", add3_f32="ppppq"),
    **_specs("reduce.cu", reduce_rows_f32="ppqi", reduce_cols_f32="ppqqqi", reduce_cols_split_f32="ppqqqi",
             reduce_max_backward_f32="ppppqqq"),
    **_specs("layout.cu", strided_copy_b32="ppq qqqqq qqqqqq qqqqqq",
             strided_copy_b16="ppq qqqqq qqqqqq qqqqqq", transpose_tiled_b32="pp qqqqqqq",
             transpose_tiled_b16="pp qqqqqqq"),
}

# the bf16 recipe's kernels that read (and write) bf16 tensors directly, with no widened float32 copies
SPECS |= {
    **_specs("norms.cu", rmsnorm_bf16in="ppppif", fused_residual_rmsnorm_bf16in="ppppppif",
             rmsnorm_backward_dx_bf16in="pppppppi", rmsnorm_backward_dw_bf16in="ppppqi",
             layernorm_backward_dx_bf16in="ppppppppi", layernorm_backward_dw_bf16in="ppppppqi"),
    **_specs("elementwise.cu", swiglu_rp_bf16io="ppqq", swiglu_backward_rp_bf16io="pppqq",
             swiglu_backward_rp_bf16x="pppqq", round_f32_bf16="ppq",
             **{f"{op}_{types}": "pppqq" for op in ("add", "mul")
                for types in ("ffh", "fhf", "fhh", "hff", "hfh", "hhf", "hhh")},
             **{f"gelu_{types}": "ppqi" for types in ("fh", "hf", "hh")},
             **{f"gelu_backward_{types}": "pppqi"
                for types in ("ffh", "fhf", "fhh", "hff", "hfh", "hhf", "hhh")}),
    **_specs("rope.cu", qkv_norm_rope_rp_bf16in="pppppppp iiiiii ff i",
             qkv_norm_rope_rp_bf16io="pppppppp iiiiii ff i",
             qkv_norm_rope_backward_rp_bf16in="ppppppppppp iiiiii f i",
             qkv_norm_rope_backward_dw_rp_bf16in="pppppppp iiiiiii f i"),
}


# kiln-dist's vocabulary parallelism: token ids mapped into a rank's rows on the device
SPECS |= _specs("vocab.cu", vocab_local_ids_i32="ppppp q iiii q")


def sources() -> list[Path]:
    """Every kernel source file of the package."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def spec(name: str) -> KernelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KilnError(f"no CUDA kernel named {name!r}; kiln.cuda has {', '.join(sorted(SPECS))}") from None


class Packed:
    """Kernel arguments packed for ``cuLaunchKernel``: ``address`` is the ``void**`` array, one pointer to
    each typed value (kept alive by this object)."""

    def __init__(self, kernel: KernelSpec, args: Sequence[object]) -> None:
        if len(args) != len(kernel.params):
            raise KilnError(f"kernel {kernel.name!r} takes {len(kernel.params)} arguments "
                            f"({kernel.params}), the launch passed {len(args)}")
        self.values = [_CTYPES[code](0 if a is None else a) for code, a in  # type: ignore[arg-type]
                       zip(kernel.params, args, strict=True)]
        self.array = (ctypes.c_void_p * max(len(self.values), 1))(
            *[ctypes.addressof(v) for v in self.values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def pack(name: str, args: Sequence[object]) -> Packed:
    return Packed(spec(name), args)
