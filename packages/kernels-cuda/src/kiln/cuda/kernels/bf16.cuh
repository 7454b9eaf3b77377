// bfloat16 as its 16 bits (NVRTC ships no cuda_bf16.h): conversions, and the tensor-core product
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) with a SIMT twin of the same fragment layout.
#pragma once
#include "common.cuh"

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 x) {
    return __uint_as_float((unsigned)x << 16);
}

// Round to nearest, ties to even (ml_dtypes' and PyTorch's rounding); a NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x rounded to bf16 and widened back: the recipe's rounding point inside a float32 kernel.
__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Element access of the kernels that read and write bf16 tensors directly (float32 math inside, no widened
// copies): a bf16 element widens exactly on load and rounds to nearest even on store; a float32 one is as is.
__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(bf16* p, long long i, float v) { p[i] = f32_to_bf16(v); }

// a * b rounded once, never contracted into an fma (NumPy's emulation rounds every product).
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef KILN_EMULATOR
    return a * b;
#else
    return __fmul_rn(a, b);
#endif
}

// Two bf16 in one 32-bit register, the lower column in the low half (the mma operand layout).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ unsigned pair_bf16(bf16 lo, bf16 hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

__device__ __forceinline__ float lo_f32(unsigned p) { return bf16_to_f32((bf16)(p & 0xffffu)); }
__device__ __forceinline__ float hi_f32(unsigned p) { return bf16_to_f32((bf16)(p >> 16)); }

// d += a b for one 16x8x16 tile, in the PTX ISA's fragment layout of mma.m16n8k16 (bf16): lane 4 g + t
// holds a (16 x 16, row-major) rows g and g + 8 at columns 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9
// (a2, a3); b (16 x 8, column-major) column g at rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1); d rows g
// (d0, d1) and g + 8 (d2, d3) at columns 2t, 2t + 1. TC: the tensor-core instruction (sm_80+); otherwise
// the SIMT twin gathers the other lanes' fragments with shuffles and sums in fp32 (the emulator runs it).
template <bool TC>
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, const unsigned* b) {
#ifndef KILN_EMULATOR
    if constexpr (TC) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
        return;
    }
#endif
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int s = 0; s < 4; ++s) {  // k = 2s, 2s + 1 (a0 / a1, b0) and 2s + 8, 2s + 9 (a2 / a3, b1)
        unsigned a0 = __shfl_sync(FULL_MASK, a[0], 4 * g + s), a1 = __shfl_sync(FULL_MASK, a[1], 4 * g + s);
        unsigned a2 = __shfl_sync(FULL_MASK, a[2], 4 * g + s), a3 = __shfl_sync(FULL_MASK, a[3], 4 * g + s);
        unsigned b00 = __shfl_sync(FULL_MASK, b[0], 8 * t + s), b10 = __shfl_sync(FULL_MASK, b[1], 8 * t + s);
        unsigned b01 = __shfl_sync(FULL_MASK, b[0], 8 * t + 4 + s);
        unsigned b11 = __shfl_sync(FULL_MASK, b[1], 8 * t + 4 + s);
        d[0] += lo_f32(a0) * lo_f32(b00) + hi_f32(a0) * hi_f32(b00) + lo_f32(a2) * lo_f32(b10) +
                hi_f32(a2) * hi_f32(b10);
        d[1] += lo_f32(a0) * lo_f32(b01) + hi_f32(a0) * hi_f32(b01) + lo_f32(a2) * lo_f32(b11) +
                hi_f32(a2) * hi_f32(b11);
        d[2] += lo_f32(a1) * lo_f32(b00) + hi_f32(a1) * hi_f32(b00) + lo_f32(a3) * lo_f32(b10) +
                hi_f32(a3) * hi_f32(b10);
        d[3] += lo_f32(a1) * lo_f32(b01) + hi_f32(a1) * hi_f32(b01) + lo_f32(a3) * lo_f32(b11) +
                hi_f32(a3) * hi_f32(b11);
    }
}
