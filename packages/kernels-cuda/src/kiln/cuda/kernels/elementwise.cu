// Elementwise ops and activations (kiln.core ops/library/_elementwise.py): one thread per element in a
// grid-stride loop; launch geometry: 256 threads, min(cdiv(n, 256), 4096) blocks (kiln.cuda._ops.ew_grid).
#include "common.cuh"

// fill / zeros / ones: out = value
extern "C" __global__ void fill_f32(float* out, float value, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = value;
}

// scale: out = x * factor
extern "C" __global__ void scale_f32(const float* x, float* out, float factor, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = x[i] * factor;
}

// add / bias_add: out = a + b, b of nb elements broadcast over a's trailing dims (nb == n: same shape)
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, long long n, long long nb) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = a[i] + b[i % nb];
}

// mul: out = a * b, b broadcast as in add_f32
extern "C" __global__ void mul_f32(const float* a, const float* b, float* out, long long n, long long nb) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = a[i] * b[i % nb];
}

// silu: out = x * sigmoid(x)
extern "C" __global__ void silu_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = x[i] * sigmoidf(x[i]);
}

// silu_backward: d_x = d * s * (1 + x * (1 - s)), s = sigmoid(x)
extern "C" __global__ void silu_backward_f32(const float* d, const float* x, float* d_x, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float s = sigmoidf(x[i]);
        d_x[i] = d[i] * s * (1.0f + x[i] * (1.0f - s));
    }
}

// relu: out = max(x, 0)
extern "C" __global__ void relu_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = fmaxf(x[i], 0.0f);
}

// relu_backward: d_x = d where x > 0, else 0
extern "C" __global__ void relu_backward_f32(const float* d, const float* x, float* d_x, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) d_x[i] = x[i] > 0.0f ? d[i] : 0.0f;
}

// gelu: x * Phi(x), the tanh approximation when tanh_approx != 0, else exact (erf)
extern "C" __global__ void gelu_f32(const float* x, float* out, long long n, int tanh_approx) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float v = x[i];
        float t = tanh_approx ? tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))
                              : erff(v * 0.7071067811865476f);
        out[i] = 0.5f * v * (1.0f + t);
    }
}

// gelu_backward: d_x = d * gelu'(x) for the same approximation
extern "C" __global__ void gelu_backward_f32(const float* d, const float* x, float* d_x, long long n,
                                             int tanh_approx) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float v = x[i], g;
        if (tanh_approx) {
            float t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));
            g = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
        } else {
            g = 0.5f * (1.0f + erff(v * 0.7071067811865476f)) + v * 0.3989422804014327f * expf(-0.5f * v * v);
        }
        d_x[i] = d[i] * g;
    }
}

// swiglu: x is [rows, 2m] laid out [gate | up]; out[r, j] = silu(gate[r, j]) * up[r, j]
extern "C" __global__ void swiglu_f32(const float* x, float* out, long long rows, long long m) {
    for (long long i = first_index(); i < rows * m; i += grid_stride()) {
        long long r = i / m, j = i % m;
        float g = x[r * 2 * m + j], u = x[r * 2 * m + m + j];
        out[i] = g * sigmoidf(g) * u;
    }
}

// swiglu_backward: d_x = [d_gate | d_up]; each thread reads its (gate, up) pair before writing it, so
// d_x may be x's own storage
extern "C" __global__ void swiglu_backward_f32(const float* d, const float* x, float* d_x, long long rows,
                                               long long m) {
    for (long long i = first_index(); i < rows * m; i += grid_stride()) {
        long long r = i / m, j = i % m;
        float g = x[r * 2 * m + j], u = x[r * 2 * m + m + j], s = sigmoidf(g);
        d_x[r * 2 * m + j] = d[i] * u * s * (1.0f + g * (1.0f - s));
        d_x[r * 2 * m + m + j] = d[i] * g * s;
    }
}

// silu_mul: out = silu(gate) * up
extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = gate[i] * sigmoidf(gate[i]) * up[i];
}

// silu_mul_backward: d_gate = d * up * silu'(gate), d_up = d * silu(gate); a null output is not written
extern "C" __global__ void silu_mul_backward_f32(const float* d, const float* gate, const float* up,
                                                 float* d_gate, float* d_up, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float g = gate[i], u = up[i], s = sigmoidf(g);
        if (d_gate) d_gate[i] = d[i] * u * s * (1.0f + g * (1.0f - s));
        if (d_up) d_up[i] = d[i] * g * s;
    }
}

// logit softcapping (fused_lm_head_loss softcap): z = cap * tanh(z / cap), in place
extern "C" __global__ void softcap_f32(float* z, long long n, float cap) {
    for (long long i = first_index(); i < n; i += grid_stride()) z[i] = cap * tanhf(z[i] / cap);
}

// its backward from the capped logits: g *= 1 - (capped / cap)^2
extern "C" __global__ void softcap_backward_f32(float* g, const float* capped, long long n, float cap) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float t = capped[i] / cap;
        g[i] *= 1.0f - t * t;
    }
}
