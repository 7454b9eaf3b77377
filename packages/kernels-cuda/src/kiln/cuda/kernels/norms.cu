// RMSNorm forward and backward (kiln.core ops/library/_norms.py): statistics over the last dim C.
// Row kernels: one block of ROW_THREADS threads per row (grid = rows); the weight gradient is a
// separate column kernel, one thread per column summing the rows in order (deterministic, no atomics).
// The RMSNorm kernels are templates over the element type of the activation they read (TX, TD: float,
// or bf16 under the bf16 recipe, widened on load, kernels/bf16.cuh): the _f32 entry points read float32,
// the _bf16in ones read that tensor as bf16 directly (no widened float32 copy); the math is float32 either way.
#include "bf16.cuh"

// rmsnorm: rstd = 1 / sqrt(mean(x^2) + eps); y = (x * rstd) * weight
template <typename TX>
__device__ void rmsnorm_row(const TX* x, const float* weight, float* y, float* rstd, int C, float eps) {
    long long row = blockIdx.x;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = load_f32(x, row * C + c);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[row * C + c] = (load_f32(x, row * C + c) * r) * weight[c];
    if (threadIdx.x == 0) rstd[row] = r;
}

extern "C" __global__ void rmsnorm_f32(const float* x, const float* weight, float* y, float* rstd, int C,
                                       float eps) {
    rmsnorm_row(x, weight, y, rstd, C, eps);
}

extern "C" __global__ void rmsnorm_bf16in(const bf16* x, const float* weight, float* y, float* rstd, int C,
                                          float eps) {
    rmsnorm_row(x, weight, y, rstd, C, eps);
}

// fused_residual_rmsnorm: residual_out = residual + x; (y, rstd) = rmsnorm(residual_out). Each thread
// writes residual_out only where it read residual and x, so residual_out may be either input's storage.
template <typename TX>
__device__ void fused_residual_rmsnorm_row(const float* residual, const TX* x, const float* weight,
                                           float* residual_out, float* y, float* rstd, int C, float eps) {
    long long row = blockIdx.x;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = residual[row * C + c] + load_f32(x, row * C + c);
        residual_out[row * C + c] = v;
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[row * C + c] = (residual_out[row * C + c] * r) * weight[c];
    if (threadIdx.x == 0) rstd[row] = r;
}

extern "C" __global__ void fused_residual_rmsnorm_f32(const float* residual, const float* x, const float* weight,
                                                      float* residual_out, float* y, float* rstd, int C,
                                                      float eps) {
    fused_residual_rmsnorm_row(residual, x, weight, residual_out, y, rstd, C, eps);
}

// x (a bf16 projection's output) read as bf16; the residual stream stays float32
extern "C" __global__ void fused_residual_rmsnorm_bf16in(const float* residual, const bf16* x, const float* weight,
                                                         float* residual_out, float* y, float* rstd, int C,
                                                         float eps) {
    fused_residual_rmsnorm_row(residual, x, weight, residual_out, y, rstd, C, eps);
}

// rmsnorm_backward, d_x of one row: d_x = rstd * (g - xhat * mean(g * xhat)), g = d_y * weight,
// xhat = x * rstd; minus d_rstd * rstd^3 * x / C; plus d_extra (a residual's gradient). d_y, d_rstd and
// d_extra may be null. Each element is read before it is written, so d_x may be d_y's or d_extra's storage.
template <typename TD>
__device__ void rmsnorm_backward_dx_row(const TD* d_y, const float* x, const float* rstd, const float* weight,
                                        const float* d_rstd, const float* d_extra, float* d_x, int C) {
    long long row = blockIdx.x;
    float r = rstd[row], dot = 0.0f;
    if (d_y) {
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            dot += load_f32(d_y, row * C + c) * weight[c] * (x[row * C + c] * r);
        dot = block_sum(dot) / C;
    }
    float dr = d_rstd ? d_rstd[row] * r * r * r / C : 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        long long i = row * C + c;
        float xv = x[i], g = 0.0f;
        if (d_y) g = r * (load_f32(d_y, i) * weight[c] - (xv * r) * dot);
        g -= dr * xv;
        if (d_extra) g += d_extra[i];
        d_x[i] = g;
    }
}

extern "C" __global__ void rmsnorm_backward_dx_f32(const float* d_y, const float* x, const float* rstd,
                                                   const float* weight, const float* d_rstd,
                                                   const float* d_extra, float* d_x, int C) {
    rmsnorm_backward_dx_row(d_y, x, rstd, weight, d_rstd, d_extra, d_x, C);
}

// d_y (the gradient of a bf16 tensor) read as bf16
extern "C" __global__ void rmsnorm_backward_dx_bf16in(const bf16* d_y, const float* x, const float* rstd,
                                                      const float* weight, const float* d_rstd,
                                                      const float* d_extra, float* d_x, int C) {
    rmsnorm_backward_dx_row(d_y, x, rstd, weight, d_rstd, d_extra, d_x, C);
}

// rmsnorm_backward, d_weight: d_weight[c] = sum over rows of d_y * x * rstd; one thread per column,
// 256 threads a block, cdiv(C, 256) blocks. Runs before the d_x kernel (d_x may take over d_y).
template <typename TD>
__device__ void rmsnorm_backward_dw_col(const TD* d_y, const float* x, const float* rstd, float* d_weight,
                                        long long rows, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.0f;
    for (long long row = 0; row < rows; ++row) acc += load_f32(d_y, row * C + c) * (x[row * C + c] * rstd[row]);
    d_weight[c] = acc;
}

extern "C" __global__ void rmsnorm_backward_dw_f32(const float* d_y, const float* x, const float* rstd,
                                                   float* d_weight, long long rows, int C) {
    rmsnorm_backward_dw_col(d_y, x, rstd, d_weight, rows, C);
}

extern "C" __global__ void rmsnorm_backward_dw_bf16in(const bf16* d_y, const float* x, const float* rstd,
                                                      float* d_weight, long long rows, int C) {
    rmsnorm_backward_dw_col(d_y, x, rstd, d_weight, rows, C);
}

// layernorm (same file of kiln.core): mean over the last dim, rstd = 1 / sqrt(mean((x - mean)^2) + eps)
// (the biased variance, two passes), y = (x - mean) * rstd * weight (+ bias). bias may be null.
extern "C" __global__ void layernorm_f32(const float* x, const float* weight, const float* bias, float* y,
                                         float* mean, float* rstd, int C, float eps) {
    long long row = blockIdx.x;
    const float* xr = x + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    float mu = block_sum(s) / C, ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += (xr[c] - mu) * (xr[c] - mu);
    float r = 1.0f / sqrtf(block_sum(ss) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = ((xr[c] - mu) * r) * weight[c];
        y[row * C + c] = bias ? v + bias[c] : v;
    }
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// layernorm_backward, d_x of one row: g = d_y * weight, xhat = (x - mean) * rstd,
// d_x = rstd * (g - mean(g) - xhat * mean(g * xhat)) + d_mean / C - d_rstd * rstd^3 * (x - mean) / C.
// d_y, d_mean and d_rstd may be null; each element is read before it is written (d_x may be d_y's storage).
// TD: d_y's element type (the _bf16in entry points read a bf16 d_y directly).
template <typename TD>
__device__ void layernorm_backward_dx_row(const TD* d_y, const float* x, const float* mean, const float* rstd,
                                          const float* weight, const float* d_mean, const float* d_rstd, float* d_x,
                                          int C) {
    long long row = blockIdx.x;
    float r = rstd[row], mu = mean[row], sg = 0.0f, sgx = 0.0f;
    if (d_y) {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float g = load_f32(d_y, row * C + c) * weight[c];
            sg += g;
            sgx += g * ((x[row * C + c] - mu) * r);
        }
        sg = block_sum(sg) / C;
        sgx = block_sum(sgx) / C;
    }
    float dm = d_mean ? d_mean[row] / C : 0.0f, dr = d_rstd ? d_rstd[row] * r * r * r / C : 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        long long i = row * C + c;
        float xc = x[i] - mu, g = 0.0f;
        if (d_y) g = r * (load_f32(d_y, i) * weight[c] - sg - (xc * r) * sgx);
        d_x[i] = g + dm - dr * xc;
    }
}

extern "C" __global__ void layernorm_backward_dx_f32(const float* d_y, const float* x, const float* mean,
                                                     const float* rstd, const float* weight, const float* d_mean,
                                                     const float* d_rstd, float* d_x, int C) {
    layernorm_backward_dx_row(d_y, x, mean, rstd, weight, d_mean, d_rstd, d_x, C);
}

extern "C" __global__ void layernorm_backward_dx_bf16in(const bf16* d_y, const float* x, const float* mean,
                                                        const float* rstd, const float* weight, const float* d_mean,
                                                        const float* d_rstd, float* d_x, int C) {
    layernorm_backward_dx_row(d_y, x, mean, rstd, weight, d_mean, d_rstd, d_x, C);
}

// layernorm_backward, d_weight and d_bias: one thread per column summing the rows in order (before the
// d_x kernel, which may take over d_y's storage). d_bias may be null.
template <typename TD>
__device__ void layernorm_backward_dw_col(const TD* d_y, const float* x, const float* mean, const float* rstd,
                                          float* d_weight, float* d_bias, long long rows, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float aw = 0.0f, ab = 0.0f;
    for (long long row = 0; row < rows; ++row) {
        float g = load_f32(d_y, row * C + c);
        aw += g * ((x[row * C + c] - mean[row]) * rstd[row]);
        ab += g;
    }
    d_weight[c] = aw;
    if (d_bias) d_bias[c] = ab;
}

extern "C" __global__ void layernorm_backward_dw_f32(const float* d_y, const float* x, const float* mean,
                                                     const float* rstd, float* d_weight, float* d_bias,
                                                     long long rows, int C) {
    layernorm_backward_dw_col(d_y, x, mean, rstd, d_weight, d_bias, rows, C);
}

extern "C" __global__ void layernorm_backward_dw_bf16in(const bf16* d_y, const float* x, const float* mean,
                                                        const float* rstd, float* d_weight, float* d_bias,
                                                        long long rows, int C) {
    layernorm_backward_dw_col(d_y, x, mean, rstd, d_weight, d_bias, rows, C);
}
