// Elementwise ops and activations (kiln.core ops/library/_elementwise.py): one thread per element in a
// grid-stride loop; launch geometry: 256 threads, min(cdiv(n, 256), 4096) blocks (kiln.cuda._ops.ew_grid).
#include "bf16.cuh"

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

// swiglu under the bf16 recipe (NumPy's swiglu_bf16): silu in fp32 rounded to bf16, then the product
// rounded. sigmoid = (1 + tanh(g / 2)) / 2 as NumPy's emulation writes it; mul_rn keeps the GPU from
// contracting a product into an fma the emulation does not have.
extern "C" __global__ void swiglu_rp_bf16(const float* x, float* out, long long rows, long long m) {
    for (long long i = first_index(); i < rows * m; i += grid_stride()) {
        long long r = i / m, j = i % m;
        float g = x[r * 2 * m + j], u = x[r * 2 * m + m + j];
        float sig = mul_rn(0.5f, 1.0f + tanhf(mul_rn(0.5f, g)));
        out[i] = round_bf16(mul_rn(round_bf16(mul_rn(g, sig)), u));
    }
}

// its backward (swiglu_backward_bf16): d_s = bf16(d * up), d_gate = bf16(d_s * silu'(gate)),
// d_up = bf16(d * bf16(silu(gate))); reads its pair before writing, so d_x may be x's storage
extern "C" __global__ void swiglu_backward_rp_bf16(const float* d, const float* x, float* d_x, long long rows,
                                                   long long m) {
    for (long long i = first_index(); i < rows * m; i += grid_stride()) {
        long long r = i / m, j = i % m;
        float g = x[r * 2 * m + j], u = x[r * 2 * m + m + j];
        float sig = mul_rn(0.5f, 1.0f + tanhf(mul_rn(0.5f, g)));
        float d_s = round_bf16(mul_rn(d[i], u));
        float grad = mul_rn(sig, 1.0f + mul_rn(g, 1.0f - sig));
        d_x[r * 2 * m + j] = round_bf16(mul_rn(d_s, grad));
        d_x[r * 2 * m + m + j] = round_bf16(mul_rn(d[i], round_bf16(mul_rn(g, sig))));
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

// Casts of the bf16 precision recipe: float32 to bf16 rounded to nearest, ties to even (ml_dtypes' and
// PyTorch's astype; NaN stays NaN, overflow goes to inf), and bf16 to float32 (exact).
extern "C" __global__ void cast_f32_bf16(const float* x, bf16* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const bf16* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = bf16_to_f32(x[i]);
}

// dropout (kiln.core ops/library/_elementwise.py): element j keeps x * scale when the uniform of counter
// offset + j is >= p: bits = splitmix64(key + (counter + 1) * GAMMA), key = splitmix64(seed) (hashed on the
// host), uniform = (bits >> 11) * 2^-53, so keep iff (bits >> 11) >= threshold = ceil(p * 2^53) (exact).
// scale = float32(1 / (1 - p)). Grid-stride; out may be x's storage.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void dropout_f32(const float* x, float* out, long long n, long long key, long long offset,
                                       long long threshold, float scale) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        unsigned long long c = (unsigned long long)offset + (unsigned long long)i;
        unsigned long long bits = mix64((unsigned long long)key + (c + 1ull) * 0x9E3779B97F4A7C15ull);
        out[i] = (long long)(bits >> 11) >= threshold ? x[i] * scale : 0.0f;
    }
}

// --- the recompute variants of the norms and the remaining pointwise ops ---------------------------
// (issue 17: every op of kiln-core's library on a kernel). Same geometry: grid-stride, ew_grid.

// rmsnorm_apply_saved (kiln.core ops/library/_norms.py, ``normalize``): y = (x * rstd[row]) * weight[c] with the
// rstd the forward saved, the two products in the forward kernels' order, so a replay gives its bits.
// Each thread reads x[i] before it writes y[i]: y may be x's storage.
extern "C" __global__ void rmsnorm_apply_saved_f32(const float* x, const float* rstd, const float* weight, float* y,
                                                   long long n, int C) {
    for (long long i = first_index(); i < n; i += grid_stride()) y[i] = (x[i] * rstd[i / C]) * weight[i % C];
}

// fused_residual_rmsnorm_apply_saved: residual_out = residual + x; y = (residual_out * rstd[row]) * weight[c]
// (fused_residual_rmsnorm_f32's sum and products); residual_out may be either input's storage.
extern "C" __global__ void fused_residual_rmsnorm_apply_saved_f32(const float* residual, const float* x,
                                                                  const float* rstd, const float* weight,
                                                                  float* residual_out, float* y, long long n,
                                                                  int C) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float v = residual[i] + x[i];
        residual_out[i] = v;
        y[i] = (v * rstd[i / C]) * weight[i % C];
    }
}

// div (ops/library/_math.py): out = a / b, b broadcast over a's trailing dims as in add_f32 (other broadcasts are
// expanded first by kiln.cuda._ops.div)
extern "C" __global__ void div_f32(const float* a, const float* b, float* out, long long n, long long nb) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = a[i] / b[i % nb];
}

// exp: out = e^x
extern "C" __global__ void exp_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = expf(x[i]);
}

// reciprocal: out = 1 / x
extern "C" __global__ void reciprocal_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = 1.0f / x[i];
}

// sigmoid, as NumPy's _sigmoid_out writes it (never overflows): e = exp(-|x|), (x >= 0 ? 1 : e) / (1 + e)
extern "C" __global__ void sigmoid_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float v = x[i], e = expf(-fabsf(v));
        out[i] = (v >= 0.0f ? 1.0f : e) / (1.0f + e);
    }
}

// sigmoid_backward from the forward's output y: d_x = d * y * (1 - y)
extern "C" __global__ void sigmoid_backward_f32(const float* d, const float* y, float* d_x, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) d_x[i] = d[i] * y[i] * (1.0f - y[i]);
}

// relu2 (squared ReLU): out = max(x, 0)^2
extern "C" __global__ void relu2_f32(const float* x, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float m = fmaxf(x[i], 0.0f);
        out[i] = m * m;
    }
}

// relu2_backward: d_x = 2 * d * max(x, 0)
extern "C" __global__ void relu2_backward_f32(const float* d, const float* x, float* d_x, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) d_x[i] = 2.0f * d[i] * fmaxf(x[i], 0.0f);
}

// geglu: out = gelu(gate) * up, gelu as in gelu_f32 (tanh approximation when tanh_approx != 0, else erf); its
// backward is a composition in kiln-core (gelu_backward, gelu and mul)
extern "C" __global__ void geglu_f32(const float* gate, const float* up, float* out, long long n, int tanh_approx) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float v = gate[i];
        float t = tanh_approx ? tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))
                              : erff(v * 0.7071067811865476f);
        out[i] = 0.5f * v * (1.0f + t) * up[i];
    }
}

// add3 (a parallel residual): out = (a + b) + c, NumPy's order
extern "C" __global__ void add3_f32(const float* a, const float* b, const float* c, float* out, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) out[i] = (a[i] + b[i]) + c[i];
}
