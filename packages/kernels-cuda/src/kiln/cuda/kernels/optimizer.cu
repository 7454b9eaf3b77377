// The optimizer phase (kiln.core ops/library/_optimizer.py): the global gradient norm and in-place
// updates. Updates run one thread per element, grid-stride (ew_grid); the scalar factors are computed
// on the host in float32 from step, lr, scale and the group's attributes, as the NumPy kernel rounds them.
#include "common.cuh"

// adamw_update: m = b1 m + c1 g; v = b2 v + c2 g^2; p = p * decay - (m / (sqrt(v) * inv_sqrt_bc2 + eps)) * step_size
// with c1 = scale (1 - b1), c2 = (1 - b2) scale^2, step_size = lr lr_scale / (1 - b1^t), decay = 1 - lr wd
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n, float b1, float b2,
                                     float c1, float c2, float inv_sqrt_bc2, float eps, float step_size,
                                     float decay) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float gi = g[i];
        float mi = m[i] * b1 + gi * c1;
        float vi = v[i] * b2 + (gi * gi) * c2;
        m[i] = mi;
        v[i] = vi;
        float w = (mi / (sqrtf(vi) * inv_sqrt_bc2 + eps)) * step_size;
        p[i] = p[i] * decay - w;
    }
}

// sgd_update: d = scale g; with momentum (buf non-null) buf = d at the first step, else
// momentum buf + damp d; the step is buf (or d + momentum buf with Nesterov); p = p * decay - lr d
extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, long long n, float scale, float momentum,
                                   float damp, int nesterov, int first, float lr, float decay) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float d = g[i] * scale;
        if (buf) {
            float b = first ? d : buf[i] * momentum + damp * d;
            buf[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        p[i] = p[i] * decay - d * lr;
    }
}

// grad_norm, first pass: partial[blockIdx.x] = sum of squares of the elements block blockIdx.x visits in
// a grid-stride loop; 256 threads, min(NORM_BLOCKS, cdiv(n, 256)) blocks (a function of n alone, so the
// order of the sum never changes); one launch per gradient into its own zeroed NORM_BLOCKS partials
extern "C" __global__ void sumsq_partial_f32(const float* x, long long n, float* partial) {
    float acc = 0.0f;
    for (long long i = first_index(); i < n; i += grid_stride()) acc += x[i] * x[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// grad_norm, second pass: out[0] = sqrt(sum of partial[0 .. n)); one block of 256 threads
extern "C" __global__ void sqrt_sum_f32(const float* partial, long long n, float* out) {
    float acc = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = sqrtf(acc);
}
