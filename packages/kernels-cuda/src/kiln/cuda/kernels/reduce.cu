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

// long columns with few outputs (R >= kiln.cuda._ops.COL_SPLIT_R, fewer than COL_SPLIT_OUTPUTS outputs): a block of
// blockDim.x adjacent columns of one outer index, its blockDim.y rows of threads splitting R: thread (x, y) folds
// rows y, y + blockDim.y, ... of column x in order, then the column's blockDim.y partials are folded by a fixed
// tree in shared memory (halves added pairwise, y below h taking y + h): the same order, so the same bits, on every
// run. blockDim.x * blockDim.y == COL_THREADS, both powers of two; grid (cdiv(inner, blockDim.x), min(outer,
// 65535)), the blocks looping over the rest of outer.
constexpr int COL_THREADS = 256;

extern "C" __global__ void reduce_cols_split_f32(const float* x, float* out, long long outer, long long R,
                                                 long long inner, int op) {
    __shared__ float part[COL_THREADS];
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int k = threadIdx.y * blockDim.x + threadIdx.x;
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const float* xc = x + o * R * inner + j;
        float v = op == 2 ? -INFINITY : 0.0f;
        if (j < inner)
            for (long long r = threadIdx.y; r < R; r += blockDim.y)
                v = op == 2 ? fmaxf(v, xc[r * inner]) : v + xc[r * inner];
        part[k] = v;
        __syncthreads();
        for (int h = blockDim.y / 2; h > 0; h >>= 1) {
            if (threadIdx.y < h) {
                float w = part[k + h * blockDim.x];
                part[k] = op == 2 ? fmaxf(part[k], w) : part[k] + w;
            }
            __syncthreads();
        }
        if (threadIdx.y == 0 && j < inner) out[o * inner + j] = op == 1 ? part[k] / (float)R : part[k];
    }
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
