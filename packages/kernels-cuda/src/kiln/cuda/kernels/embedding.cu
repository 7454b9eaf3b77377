// Embedding lookup and its deterministic backward (kiln.core ops/library/_loss.py embedding,
// embedding_backward); token ids are int32.
#include "common.cuh"

// out[n, c] = weight[ids[n], c]; one thread per element, grid-stride (ew_grid over N * C)
extern "C" __global__ void embedding_f32(const int* ids, const float* weight, float* out, long long N, int C) {
    for (long long i = first_index(); i < N * C; i += grid_stride()) out[i] = weight[(long long)ids[i / C] * C + i % C];
}

// d_weight[v, c] = sum of d_out[n, c] over the n with ids[n] == v, in order of n. Thread (c, y) owns column c
// of the vocabulary rows [y * rows_per_part, (y + 1) * rows_per_part): it zeroes them, then scans every
// token in order, so each sum has one writer and a fixed order (no atomics). Grid (cdiv(C, 256), parts),
// 256 threads. The padding row (padding_idx >= 0) gets no gradient.
extern "C" __global__ void embedding_backward_f32(const float* d_out, const int* ids, float* d_weight, long long N,
                                                  int C, int V, int rows_per_part, int padding_idx) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    int lo = blockIdx.y * rows_per_part, hi = min(lo + rows_per_part, V);
    for (int v = lo; v < hi; ++v) d_weight[(long long)v * C + c] = 0.0f;
    for (long long n = 0; n < N; ++n) {
        int v = ids[n];
        if (v >= lo && v < hi && v != padding_idx) d_weight[(long long)v * C + c] += d_out[n * C + c];
    }
}
