// Helpers shared by kiln's CUDA kernels: block-wide reductions over warp shuffles.
// Row kernels run one block per row with blockDim.x a multiple of 32 (at most 1024); every thread of
// the block gets the same result, reduced in a fixed order (deterministic from run to run).
#pragma once

#ifndef INFINITY  // NVRTC has no <math.h>; the emulator's does
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
}

// Sum over the block: each warp reduces its lanes, then every warp reduces the per-warp parts.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading part
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    unsigned lane = threadIdx.x % 32;
    return warp_sum(lane < blockDim.x / 32 ? part[lane] : 0.0f);
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    v = warp_max(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    unsigned lane = threadIdx.x % 32;
    return warp_max(lane < blockDim.x / 32 ? part[lane] : -INFINITY);
}

// Grid-stride loop index for elementwise kernels over n elements.
__device__ __forceinline__ long long first_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

__device__ __forceinline__ float sigmoidf(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// ALiBi's slope of head h of n (kiln.core's alibi_slopes): 2^(-8 (h + 1) / p) for the power of two p <= n, the
// remaining heads every other slope of 2p heads.
__device__ __forceinline__ float alibi_slope(int h, int heads) {
    int p = 1;
    while (2 * p <= heads) p *= 2;
    return h < p ? exp2f(-8.0f * (h + 1) / p) : exp2f(-4.0f * (2 * (h - p) + 1) / p);
}
