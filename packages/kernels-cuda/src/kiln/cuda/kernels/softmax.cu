// Softmax over one axis (kiln.core ops/library/_elementwise.py softmax, softmax_backward). The tensor is
// viewed as [outer, C, inner] with the axis in the middle; one block of 256 threads per (outer, inner)
// line: grid = outer * inner.
#include "common.cuh"

// softmax: y = exp(x - max) / sum(exp(x - max)) along the axis
extern "C" __global__ void softmax_f32(const float* x, float* y, int C, long long inner) {
    long long o = blockIdx.x / inner, in = blockIdx.x % inner, base = o * C * inner + in;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, x[base + c * inner]);
    m = block_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += expf(x[base + c * inner] - m);
    s = block_sum(s);
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[base + c * inner] = expf(x[base + c * inner] - m) / s;
}

// softmax_backward: d_x = y * (d - sum(d * y)) along the axis
extern "C" __global__ void softmax_backward_f32(const float* d, const float* y, float* d_x, int C,
                                                long long inner) {
    long long o = blockIdx.x / inner, in = blockIdx.x % inner, base = o * C * inner + in;
    float dot = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot += d[base + c * inner] * y[base + c * inner];
    dot = block_sum(dot);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        long long i = base + c * inner;
        d_x[i] = y[i] * (d[i] - dot);
    }
}
