// Reductions over an axis (kiln.core ops/library/_elementwise.py: reduce_sum, reduce_mean, reduce_max and the
// backward ops). kiln.cuda._ops views x as [outer, R, inner] with the reduced axes as R (non-adjacent reduced
// axes are first gathered next to each other by the strided copy of layout.cu). Every sum runs in a fixed
// order, so the same inputs give the same bits on every run.
#include "common.cuh"

// op: 0 sum, 1 mean (the sum divided by R), 2 max

// inner == 1 and long rows (R >= kiln.cuda._ops.ROW_REDUCE): a block per output (grid = outer, row_block(R)
// threads): each thread its strided part in order, then the block's fixed reduction tree (common.cuh)
extern "C" __global__ void reduce_rows_f32(const float* x, float* out, long long R, int op) {
    const float* xr = x + blockIdx.x * R;
    float v;
    if (op == 2) {
        v = -INFINITY;
        for (long long r = threadIdx.x; r < R; r += blockDim.x) v = fmaxf(v, xr[r]);
        v = block_max(v);
    } else {
        v = 0.0f;
        for (long long r = threadIdx.x; r < R; r += blockDim.x) v += xr[r];
        v = block_sum(v);
        if (op == 1) v /= (float)R;
    }
    if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// otherwise a thread per output (o, j), summing the R elements of its column in order (neighbouring threads read
// neighbouring columns); 256 threads a block, cdiv(outer * inner, 256) blocks
extern "C" __global__ void reduce_cols_f32(const float* x, float* out, long long outer, long long R, long long inner,
                                           int op) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= outer * inner) return;
    const float* xc = x + (t / inner) * R * inner + t % inner;
    float v = op == 2 ? -INFINITY : 0.0f;
    for (long long r = 0; r < R; ++r) v = op == 2 ? fmaxf(v, xc[r * inner]) : v + xc[r * inner];
    out[t] = op == 1 ? v / (float)R : v;
}

// reduce_max_backward: d_x = d at the maxima of each reduced group (ties share it evenly: d / count), else 0.
// A thread per output (o, j): it counts the ties along R, then writes its R elements of d_x.
extern "C" __global__ void reduce_max_backward_f32(const float* d, const float* x, const float* y, float* d_x,
                                                   long long outer, long long R, long long inner) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= outer * inner) return;
    long long base = (t / inner) * R * inner + t % inner;
    float m = y[t];
    int count = 0;
    for (long long r = 0; r < R; ++r) count += x[base + r * inner] == m;
    float g = d[t] / (float)count;
    for (long long r = 0; r < R; ++r) d_x[base + r * inner] = x[base + r * inner] == m ? g : 0.0f;
}
