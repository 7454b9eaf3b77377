// The optimizer phase (kiln.core ops/library/_optimizer.py): the global gradient norm and in-place
// updates. Updates run one thread per element, grid-stride (ew_grid); the scalar factors are computed
// on the host in float32 from step, lr, scale and the group's attributes, as the NumPy kernel rounds them.
#include "common.cuh"

// adamw_update: m = b1 m + c1 g; v = b2 v + c2 g^2; p = p * decay - (m / (sqrt(v) * inv_sqrt_bc2 + eps)) * step_size
// with c1 = scale (1 - b1), c2 = (1 - b2) scale^2, step_size = lr lr_scale / (1 - b1^t), decay = 1 - lr wd
__device__ __forceinline__ void adamw_element(float* p, const float* g, float* m, float* v, long long i, float b1,
                                              float b2, float c1, float c2, float inv_sqrt_bc2, float eps,
                                              float step_size, float decay) {
    float gi = g[i];
    float mi = m[i] * b1 + gi * c1;
    float vi = v[i] * b2 + (gi * gi) * c2;
    m[i] = mi;
    v[i] = vi;
    float w = (mi / (sqrtf(vi) * inv_sqrt_bc2 + eps)) * step_size;
    p[i] = p[i] * decay - w;
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n, float b1, float b2,
                                     float c1, float c2, float inv_sqrt_bc2, float eps, float step_size,
                                     float decay) {
    for (long long i = first_index(); i < n; i += grid_stride())
        adamw_element(p, g, m, v, i, b1, b2, c1, c2, inv_sqrt_bc2, eps, step_size, decay);
}

// adamw_update of k tensors of one parameter group (the same scalars) in one launch: tensor t has the
// pointers ptrs[4 t .. 4 t + 3] (p, g, m, v) and the elements [offsets[t], offsets[t + 1]) of their
// concatenation; each element finds its tensor by binary search, then adamw_f32's math. Elementwise
// geometry over offsets[k].
extern "C" __global__ void adamw_multi_f32(const unsigned long long* ptrs, const long long* offsets, int k,
                                           float b1, float b2, float c1, float c2, float inv_sqrt_bc2, float eps,
                                           float step_size, float decay) {
    for (long long i = first_index(); i < offsets[k]; i += grid_stride()) {
        int lo = 0, hi = k - 1;
        while (lo < hi) {  // the last t with offsets[t] <= i
            int mid = (lo + hi + 1) / 2;
            if (offsets[mid] <= i) lo = mid;
            else hi = mid - 1;
        }
        const unsigned long long* t = ptrs + 4 * lo;
        adamw_element((float*)t[0], (const float*)t[1], (float*)t[2], (float*)t[3], i - offsets[lo], b1, b2, c1,
                      c2, inv_sqrt_bc2, eps, step_size, decay);
    }
}

// The optimizer phase's run-time scalars on the device (kiln.cuda._ops.SCALARS), so a captured step needs
// no host: scalars[0] the global gradient norm, [1] the clipping factor (the host writes the clipping
// threshold there, which clip_scale_f32 replaces by the factor), [2] the learning rate; then per
// AdamW group g, from 3 + 3 g: lr lr_scale / (1 - b1^t), 1 / sqrt(1 - b2^t) and the decay 1 - lr lr_scale wd,
// written by the host before each step (they depend on the step number and the schedule alone).

// clip: scalars[1] = max_norm / (norm + 1e-6) when norm > max_norm, else 1, max_norm the threshold the host
// wrote in scalars[1] (< 0: no clipping) (Optimizer.clip_scale); one thread
extern "C" __global__ void clip_scale_f32(float* scalars) {
    float norm = scalars[0], max_norm = scalars[1];
    scalars[1] = (max_norm >= 0.0f && norm > max_norm) ? max_norm / (norm + 1e-6f) : 1.0f;
}

// adamw_multi_f32 with its scalar factors read from the device: c1 = scale (1 - b1), c2 = (1 - b2) scale^2
// with scale = scalars[1], the group's three factors at scalars[slot ..]
extern "C" __global__ void adamw_multi_dev_f32(const unsigned long long* ptrs, const long long* offsets, int k,
                                               const float* scalars, int slot, float b1, float b2,
                                               float one_minus_b1, float one_minus_b2, float eps) {
    float scale = scalars[1], step_size = scalars[slot], inv_sqrt_bc2 = scalars[slot + 1];
    float decay = scalars[slot + 2], c1 = scale * one_minus_b1, c2 = one_minus_b2 * scale * scale;
    for (long long i = first_index(); i < offsets[k]; i += grid_stride()) {
        int lo = 0, hi = k - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (offsets[mid] <= i) lo = mid;
            else hi = mid - 1;
        }
        const unsigned long long* t = ptrs + 4 * lo;
        adamw_element((float*)t[0], (const float*)t[1], (float*)t[2], (float*)t[3], i - offsets[lo], b1, b2, c1,
                      c2, inv_sqrt_bc2, eps, step_size, decay);
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
