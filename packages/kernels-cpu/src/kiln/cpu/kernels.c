/* kiln's fused CPU kernels (float32, row-major, contiguous), one function per op, threaded with
 * OpenMP over blocks of rows (or of a flat array). Each names the NumPy reference it must match;
 * tests/test_kernels.py checks it against that reference. Pointers may alias where the op declares
 * an in-place input (each element is read before it is written); NULL marks an absent optional.
 * Reductions that cross rows (d_weight) sum fixed blocks of rows in order, so results do not depend
 * on the number of threads. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

/* rows per block of a cross-row reduction: a cut that depends on the shape only */
#define ROW_BLOCK 32

/* a * b + c, fused (one rounding) where the CPU has FMA (the compiler's target: -march=native), else
 * two roundings; only in the approximations below, whose error bounds hold either way */
#if defined(__FMA__) || defined(__aarch64__)
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* e^r for |r| <= ln2 / 2: 1 + r + r^2 P(r), P of degree 5 */
static inline float exp_poly(float r) {
    float p = 1.9875691500e-4f;
    p = MADD(p, r, 1.3981999507e-3f);
    p = MADD(p, r, 8.3334519073e-3f);
    p = MADD(p, r, 4.1665795894e-2f);
    p = MADD(p, r, 1.6666665459e-1f);
    p = MADD(p, r, 5.0000001201e-1f);
    return MADD(p, r * r, r) + 1.0f;
}

/* 2^n for an integral float n in [-127, 128] (-127: 0, 128: inf), put into the exponent bits */
static inline float pow2_int(float n) {
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return two_n;
}

/* e^x in float32 to ~2 ulp, written so that loops over it vectorize (glibc's expf does not without
 * -ffast-math): x = n ln2 + r, e^r by a degree-6 polynomial, 2^n put into the exponent bits. */
static inline float exp_f(float x_in) {
    float x = x_in > -87.3f ? x_in : -87.3f;  /* below: 0 (returned at the end); above: ~inf */
    x = x < 88.7f ? x : 88.7f;
    float n = rintf(x * 1.44269504088896341f);
    float r = MADD(n, -0.693145751953125f, x);  /* ln2 in two parts: n times the first is exact */
    r = MADD(n, -1.428606765330187045e-06f, r);
    float e = exp_poly(r) * pow2_int(n);
    return x_in < -87.3f ? 0.0f : e;  /* e^-inf = 0: masked scores */
}

/* e^(hi + lo) for hi in [-87.3, 0] (below: 0), |lo| < 1: the argument's low part kept out of the sum that
 * would round it away (hi - n ln2 is exact, lo joins the small remainder) */
static inline float exp_hi_lo(float hi, float lo) {
    float x = hi > -87.3f ? hi : -87.3f;
    float n = rintf((x + lo) * 1.44269504088896341f);
    float r = MADD(n, -0.693145751953125f, x) + lo;
    r = MADD(n, -1.428606765330187045e-06f, r);
    float e = exp_poly(r) * pow2_int(n);
    return hi < -87.3f ? 0.0f : e;
}

/* the rounding error of a2 = a * a (a * a - a2 exactly): a fused multiply-add where there is one, else
 * Dekker's product of a's two 12-bit halves */
static inline float square_lo(float a, float a2) {
#if defined(__FMA__) || defined(__aarch64__)
    return fmaf(a, a, -a2);
#else
    float t = a * 4097.0f, ah = t - (t - a), al = a - ah;
    return ((ah * ah - a2) + 2.0f * ah * al) + al * al;
#endif
}

/* The standard normal distribution, vectorised in float32 (glibc's erfc is scalar double): for a = |x|,
 * Q(a) = P(X > a) = C u e^(-a^2 / 2 + T(s)), u = 1 / (1 + 3a/8), s = (1 - 29a/56) u: u mapped from
 * [0.16, 1] (a in [0, 14]; past it Q is below float32's range) onto [-1, 1] without the cancellation of
 * 2.38u - 1.38, and C e^T(s) = e^(log(Q / u) + a^2 / 2), a smooth function of u, fitted by a
 * degree-10 polynomial (least squares with Lawson's weights, float64, against 0.5 erfc(a / sqrt 2);
 * error 4e-9). a^2 / 2 enters the exponential with its rounding error
 * (square_lo), so Q keeps its relative accuracy where it is tiny: Phi(x) = Q(-x) for x < 0 has no
 * cancellation, and 1 - Q(x) for x >= 0 none either (Q <= 1/2). Returns Phi(x); *gauss (unless NULL)
 * gets e^(-x^2 / 2). tests/test_kernels.py measures the error against float64 math.erf. */
static inline float norm_cdf(float x, float *gauss) {
    float a = fabsf(x);
    a = a < 20.0f ? a : 20.0f;  /* Q(20) is 0 in float32 already; inf (and NaN) would make NaNs below */
    float a2 = a * a;
    float hi = -0.5f * a2, lo = -0.5f * square_lo(a, a2);
    float den = MADD(a, 0.375f, 1.0f), u = 1.0f / den;
    float s = MADD(a, -0.5178571428571429f, 1.0f) * u;
    float t = -3.170887e-05f;
    t = MADD(t, s, 3.0458486e-05f);
    t = MADD(t, s, 2.2130746e-04f);
    t = MADD(t, s, -4.2870917e-04f);
    t = MADD(t, s, -8.115788e-04f);
    t = MADD(t, s, 3.5699948e-03f);
    t = MADD(t, s, 1.6265098e-03f);
    t = MADD(t, s, -2.9670535e-02f);
    t = MADD(t, s, -3.614845e-04f);
    t = MADD(t, s, 5.4515165e-01f);
    t = t * s;
    float q = (0.29746965f * u) * exp_hi_lo(hi, lo + t);
#if defined(__FMA__) || defined(__aarch64__)
    q = fmaf(q, fmaf(-u, den, 1.0f), q);  /* u's rounding error, 1 - u den, taken off */
#endif
    if (gauss) *gauss = exp_hi_lo(hi, lo);
    return x < 0.0f ? q : 1.0f - q;
}

/* sigmoid(x) = 1 / (1 + e^-x) */
static inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

/* ---- rmsnorm (reference: kiln.core.ops.library._norms) -------------------------------------------
 * res = a + x when a is given (fused_residual_rmsnorm), else the input is x; rstd = 1/sqrt(mean(in^2)
 * + eps), computed (and written to rstd) unless rstd_in is given (the *_apply_saved variants);
 * y = (in * rstd) * w, the same two products as NumPy's normalize(), so the variants agree bitwise. */
void kiln_rmsnorm_fwd(const float *a, const float *x, const float *w, const float *rstd_in, float *res,
                      float *y, float *rstd, i64 n, i64 c, float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < n; i++) {
        const float *xi = x + i * c;
        const float *in = xi;
        if (a) {
            const float *ai = a + i * c;
            float *ri = res + i * c;
            #pragma omp simd
            for (i64 j = 0; j < c; j++) ri[j] = ai[j] + xi[j];
            in = ri;
        }
        float r;
        if (rstd_in) {
            r = rstd_in[i];
        } else {
            double s = 0.0;
            #pragma omp simd reduction(+:s)
            for (i64 j = 0; j < c; j++) s += (double)in[j] * (double)in[j];
            r = (float)(1.0 / sqrt(s / (double)c + (double)eps));
            rstd[i] = r;
        }
        float *yi = y + i * c;
        #pragma omp simd
        for (i64 j = 0; j < c; j++) yi[j] = (in[j] * r) * w[j];
    }
}

/* d_x = rstd * (g - xhat * mean(g * xhat)) - d_rstd * rstd^3 * x / C + d_extra, g = d_y * w,
 * xhat = x * rstd; d_weight = sum over rows of d_y * xhat; dx2 (if given) gets a copy of d_x
 * (fused_residual_rmsnorm_backward's equal d_residual and d_x). Reference: rmsnorm_grad_into. */
void kiln_rmsnorm_bwd(const float *dy, const float *x, const float *rstd, const float *w,
                      const float *drstd, const float *dextra, float *dx, float *dx2, float *dw,
                      i64 n, i64 c, int nt) {
    i64 blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
    double *part = (dw && dy) ? (double *)calloc((size_t)(blocks * c), sizeof(double)) : NULL;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 b = 0; b < blocks; b++) {
        i64 end = (b + 1) * ROW_BLOCK < n ? (b + 1) * ROW_BLOCK : n;
        for (i64 i = b * ROW_BLOCK; i < end; i++) {
            const float *xi = x + i * c;
            float *dxi = dx + i * c;
            float r = rstd[i];
            if (dy) {
                const float *dyi = dy + i * c;
                double s = 0.0;
                #pragma omp simd reduction(+:s)
                for (i64 j = 0; j < c; j++) s += (double)(dyi[j] * w[j]) * (double)(xi[j] * r);
                float mean = (float)(s / (double)c);
                if (part) {
                    double *pb = part + b * c;
                    #pragma omp simd
                    for (i64 j = 0; j < c; j++) pb[j] += (double)dyi[j] * (double)(xi[j] * r);
                }
                #pragma omp simd
                for (i64 j = 0; j < c; j++) dxi[j] = r * (dyi[j] * w[j] - (xi[j] * r) * mean);
            } else {
                memset(dxi, 0, (size_t)c * sizeof(float));
            }
            if (drstd) {
                float k = drstd[i] * r * r * r / (float)c;
                #pragma omp simd
                for (i64 j = 0; j < c; j++) dxi[j] -= k * xi[j];
            }
            if (dextra) {
                const float *ei = dextra + i * c;
                #pragma omp simd
                for (i64 j = 0; j < c; j++) dxi[j] += ei[j];
            }
            if (dx2) memcpy(dx2 + i * c, dxi, (size_t)c * sizeof(float));
        }
    }
    if (dw) {
        #pragma omp parallel for schedule(static) num_threads(nt)
        for (i64 j = 0; j < c; j++) {
            double s = 0.0;
            if (part)
                for (i64 b = 0; b < blocks; b++) s += part[b * c + j];
            dw[j] = (float)s;
        }
    }
    free(part);
}

/* ---- SwiGLU (reference: kiln.core.ops.library._elementwise) --------------------------------------
 * x rows are [gate | up] (2m wide): out = silu(gate) * up; silu(g) = g * sigmoid(g). */
void kiln_swiglu_fwd(const float *x, float *out, i64 n, i64 m, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < n; i++) {
        const float *g = x + i * 2 * m, *u = g + m;
        float *o = out + i * m;
        #pragma omp simd
        for (i64 j = 0; j < m; j++) o[j] = g[j] * sigmoid_f(g[j]) * u[j];
    }
}

/* d_gate = d * up * s * (1 + gate * (1 - s)), d_up = d * gate * s, s = sigmoid(gate); dx rows are
 * [d_gate | d_up] and may be x itself (swiglu_backward's in-place input): gate[j] and up[j] are read
 * before d_gate[j] and d_up[j] are written. */
void kiln_swiglu_bwd(const float *d, const float *x, float *dx, i64 n, i64 m, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < n; i++) {
        const float *g = x + i * 2 * m, *u = g + m, *di = d + i * m;
        float *dg = dx + i * 2 * m, *du = dg + m;
        #pragma omp simd
        for (i64 j = 0; j < m; j++) {
            float gj = g[j], uj = u[j], s = sigmoid_f(gj);
            dg[j] = di[j] * uj * s * (1.0f + gj * (1.0f - s));
            du[j] = di[j] * gj * s;
        }
    }
}

/* silu: out = x * sigmoid(x); its backward d_x = d * s * (1 + x * (1 - s)), s = sigmoid(x) (out and
 * d_x may alias an input: each element is read before it is written). */
void kiln_silu_fwd(const float *x, float *out, i64 size, int nt) {
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) out[j] = x[j] * sigmoid_f(x[j]);
}

void kiln_silu_bwd(const float *d, const float *x, float *dx, i64 size, int nt) {
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) {
        float xj = x[j], s = sigmoid_f(xj);
        dx[j] = d[j] * (s * (1.0f + xj * (1.0f - s)));
    }
}

/* silu_mul: the same with gate and up as two arrays (out = silu(gate) * up) and its backward. */
void kiln_silu_mul_fwd(const float *g, const float *u, float *out, i64 size, int nt) {
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) out[j] = g[j] * sigmoid_f(g[j]) * u[j];
}

void kiln_silu_mul_bwd(const float *d, const float *g, const float *u, float *dg, float *du, i64 size,
                       int nt) {
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) {
        float gj = g[j], uj = u[j], s = sigmoid_f(gj);
        dg[j] = d[j] * uj * s * (1.0f + gj * (1.0f - s));
        du[j] = d[j] * gj * s;
    }
}

/* ---- gelu and geglu (reference: kiln.core.ops.library._elementwise) -------------------------------
 * Exact: gelu(x) = x Phi(x) by norm_cdf, vectorised (no cancellation for negative x, where the
 * reference's 1 + erf loses digits); its derivative Phi(x) + x phi(x), phi(x) = e^(-x^2 / 2) / sqrt(2 pi).
 * Tanh form: (1 + tanh(u)) / 2 = sigmoid(2 u), u = sqrt(2/pi) (x + 0.044715 x^3), so gelu = x s with
 * s = sigmoid(2 u) and its derivative s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 0.044715 x^2): float32 and
 * the vectorised exp, no cancellation either. out = gelu(x) * up when up is given (geglu). */
static inline float gelu_tanh_s(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    return sigmoid_f(2.0f * u);
}

void kiln_gelu_fwd(const float *x, const float *up, float *out, i64 size, int tanh_form, int nt) {
    if (tanh_form && up) {
        #pragma omp parallel for simd schedule(static) num_threads(nt)
        for (i64 j = 0; j < size; j++) out[j] = (x[j] * gelu_tanh_s(x[j])) * up[j];
        return;
    }
    if (tanh_form) {
        #pragma omp parallel for simd schedule(static) num_threads(nt)
        for (i64 j = 0; j < size; j++) out[j] = x[j] * gelu_tanh_s(x[j]);
        return;
    }
    if (up) {
        #pragma omp parallel for simd schedule(static) num_threads(nt)
        for (i64 j = 0; j < size; j++) out[j] = (x[j] * norm_cdf(x[j], NULL)) * up[j];
        return;
    }
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) out[j] = x[j] * norm_cdf(x[j], NULL);
}

void kiln_gelu_bwd(const float *d, const float *x, float *dx, i64 size, int tanh_form, int nt) {
    if (tanh_form) {
        #pragma omp parallel for simd schedule(static) num_threads(nt)
        for (i64 j = 0; j < size; j++) {
            float xj = x[j], s = gelu_tanh_s(xj);
            dx[j] = d[j] * (s + 2.0f * xj * s * (1.0f - s) * 0.7978845608f * (1.0f + 0.134145f * xj * xj));
        }
        return;
    }
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) {
        float g, phi = norm_cdf(x[j], &g);
        dx[j] = d[j] * MADD(x[j], 0.3989422804f * g, phi);
    }
}

/* ---- AdamW (reference: kiln.core.ops.library._optimizer.adamw_update) ----------------------------
 * One pass over p, g, m, v with the reference's float32 operations in its order (constants rounded
 * to float32 as NumPy rounds Python floats), so the update equals it bit for bit:
 * m = b1 m + (scale (1 - b1)) g; v = b2 v + ((1 - b2) scale^2) g^2;
 * p = p * decay - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps). */
void kiln_adamw(float *p, const float *g, float *m, float *v, i64 size, float g1, float b1, float g2,
                float b2, float inv_sqrt_bc2, float eps, float lr_bc1, float decay, int use_decay, int nt) {
    #pragma omp parallel for simd schedule(static) num_threads(nt)
    for (i64 j = 0; j < size; j++) {
        float gj = g[j];
        float mj = m[j] * b1 + gj * g1;
        float vj = v[j] * b2 + (gj * gj) * g2;
        m[j] = mj;
        v[j] = vj;
        float upd = (mj / (sqrtf(vj) * inv_sqrt_bc2 + eps)) * lr_bc1;
        float pj = use_decay ? p[j] * decay : p[j];
        p[j] = pj - upd;
    }
}

/* ---- the LM head's loss and gradient (reference: kiln.core.ops.library._loss.fused_lm_head_loss_and_grad)
 * The softmax of a tile of logits z [rows, v] (the products around it stay BLAS's), one row per
 * iteration and one pass over it after its max: E = exp(z - m) in place, lse = m + log(sum E),
 * loss = lse - z[target] (0 for an ignored row, target < 0), E[target] -= sum E, and
 * scale = d_loss / sum E, so that the logits' gradient is scale * E. */
void kiln_lm_head_softmax(float *z, const int64_t *target, const float *dl, float *lse, float *loss,
                          float *scale, i64 rows, i64 v, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < rows; i++) {
        float *zi = z + i * v;
        i64 t = target[i];
        float picked = t >= 0 ? zi[t] : 0.0f;
        float m = -INFINITY;
        #pragma omp simd reduction(max:m)
        for (i64 j = 0; j < v; j++) m = zi[j] > m ? zi[j] : m;
        double total = 0.0;  /* float partial sums of 256 terms in vector lanes, as sum_exp */
        for (i64 j0 = 0; j0 < v; j0 += 256) {
            i64 j1 = j0 + 256 < v ? j0 + 256 : v;
            float part = 0.0f;
            #pragma omp simd reduction(+:part)
            for (i64 j = j0; j < j1; j++) {
                float e = exp_f(zi[j] - m);
                zi[j] = e;
                part += e;
            }
            total += (double)part;
        }
        float l = m + (float)log(total);
        lse[i] = l;
        loss[i] = t >= 0 ? l - picked : 0.0f;
        if (t >= 0) zi[t] -= (float)total;
        scale[i] = dl[i] / (float)total;
    }
}

/* ---- embedding_backward (reference: kiln.core.ops.library._loss, np.add.at) ---------------------
 * dw = 0, then dw[ids[i]] += d[i] for i in order: each thread owns a range of the table's rows (it
 * zeroes them and adds the rows of d whose id falls in it), so every element sums in the order of
 * occurrence, as np.add.at does, whatever the threads. The ids are checked by the caller. */
void kiln_embedding_bwd(const float *d, const int64_t *ids, float *dw, i64 n, i64 v, i64 c, int nt) {
    #pragma omp parallel num_threads(nt)
    {
        i64 t = omp_get_thread_num(), k = omp_get_num_threads();
        i64 lo = v * t / k, hi = v * (t + 1) / k;
        memset(dw + lo * c, 0, (size_t)((hi - lo) * c) * sizeof(float));
        for (i64 i = 0; i < n; i++) {
            i64 r = ids[i];
            if (r < lo || r >= hi) continue;
            float *y = dw + r * c;
            const float *x = d + i * c;
            #pragma omp simd
            for (i64 j = 0; j < c; j++) y[j] += x[j];
        }
    }
}

/* sum over j < n of exp(x[j] - m) in double, from float partial sums of 256 terms each summed in
 * vector lanes (a double sum inside the exp loop would not vectorize) */
static inline double sum_exp(const float *x, i64 n, float m) {
    double total = 0.0;
    for (i64 j0 = 0; j0 < n; j0 += 256) {
        i64 j1 = j0 + 256 < n ? j0 + 256 : n;
        float part = 0.0f;
        #pragma omp simd reduction(+:part)
        for (i64 j = j0; j < j1; j++) part += exp_f(x[j] - m);
        total += (double)part;
    }
    return total;
}

/* ---- cross_entropy and its backward (reference: kiln.core.ops.library._loss) ---------------------
 * On logits z [rows, v], one row per iteration: lse = m + log(sum exp(z - m)), loss = lse - z[target]
 * (0 for an ignored row, target < 0); the backward d_z = exp(z - lse) (dl + dlse) - onehot(target) dl,
 * dl already 0 on ignored rows, dlse NULL for none. */
void kiln_cross_entropy_fwd(const float *z, const int64_t *target, float *loss, float *lse, i64 rows, i64 v,
                            int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < rows; i++) {
        const float *zi = z + i * v;
        float m = -INFINITY;
        #pragma omp simd reduction(max:m)
        for (i64 j = 0; j < v; j++) m = zi[j] > m ? zi[j] : m;
        float l = m + (float)log(sum_exp(zi, v, m));
        lse[i] = l;
        loss[i] = target[i] >= 0 ? l - zi[target[i]] : 0.0f;
    }
}

void kiln_cross_entropy_bwd(const float *z, const int64_t *target, const float *lse, const float *dl,
                            const float *dlse, float *dz, i64 rows, i64 v, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < rows; i++) {
        const float *zi = z + i * v;
        float *yi = dz + i * v, l = lse[i], a = dl[i] + (dlse ? dlse[i] : 0.0f);
        #pragma omp simd
        for (i64 j = 0; j < v; j++) yi[j] = exp_f(zi[j] - l) * a;
        if (target[i] >= 0) yi[target[i]] -= dl[i];
    }
}

/* ---- fused_lm_head_loss and its backward (reference: kiln.core.ops.library._loss) -----------------
 * The logits of a tile of rows come chunk by chunk of the vocabulary (BLAS's products), z [rows, cols]
 * for vocabulary columns [v0, v0 + cols); target[i] < 0: an ignored row.
 * Forward, one pass per row of a chunk after its max (an online log-sum-exp): m = the running max,
 * s = the running sum of exp(z - m) (in double), picked = the target's logit when the chunk holds it. */
void kiln_lse_chunk(const float *z, i64 rows, i64 cols, i64 v0, const int64_t *target, float *m, double *s,
                    float *picked, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < rows; i++) {
        const float *zi = z + i * cols;
        float mx = -INFINITY;
        #pragma omp simd reduction(max:mx)
        for (i64 j = 0; j < cols; j++) mx = zi[j] > mx ? zi[j] : mx;
        float mn = mx > m[i] ? mx : m[i];
        i64 t = target[i] - v0;
        if (t >= 0 && t < cols) picked[i] = zi[t];
        if (mn == -INFINITY) continue;  /* every logit so far -inf: nothing to add */
        double total = sum_exp(zi, cols, mn);
        s[i] = s[i] * exp((double)m[i] - (double)mn) + total;
        m[i] = mn;
    }
}

/* Backward, in place: z becomes d(sum dl loss + dlse lse) / dz = exp(z - lse) (dl + dlse) - onehot dl
 * (dl already 0 on ignored rows, dlse NULL for none). */
void kiln_logits_grad(float *z, i64 rows, i64 cols, i64 v0, const int64_t *target, const float *lse,
                      const float *dl, const float *dlse, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < rows; i++) {
        float *zi = z + i * cols, l = lse[i], a = dl[i] + (dlse ? dlse[i] : 0.0f);
        #pragma omp simd
        for (i64 j = 0; j < cols; j++) zi[j] = exp_f(zi[j] - l) * a;
        i64 t = target[i] - v0;
        if (t >= 0 && t < cols) zi[t] -= dl[i];
    }
}

/* ---- qkv_qk_norm_rope (reference: kiln.core.ops.library._attention) ------------------------------
 * Per head of q and of k of packed qkv rows [q heads | k heads | v heads]: z = x * w * rstd (rstd of
 * the head's rmsnorm; z = x and rstd = 1 without a weight), then rope on the first 2h dims: pairs
 * (z1, z2) -> (z1 cos - z2 sin, z2 cos + z1 sin), the halves or (interleaved) the even and odd dims;
 * v copied. cos and sin are [T, h] (per_batch: [B, T, h]), the reference's rope_tables. */
typedef struct {
    i64 b, t, hq, hkv, d, h, f;
    int per_batch, interleaved;
    const float *cos, *sin;
} rope_shape;

static inline void pair(const rope_shape *s, i64 k, i64 *a, i64 *b) {
    *a = s->interleaved ? 2 * k : k;
    *b = s->interleaved ? 2 * k + 1 : k + s->h;
}

/* y = rotate(z) by the row's tables, sign -1: the inverse rotation; y and z may not overlap */
static void rotate(const rope_shape *s, const float *c, const float *sn, const float *z, float *y, float sign) {
    for (i64 k = 0; k < s->h; k++) {
        i64 a, b;
        pair(s, k, &a, &b);
        float z1 = z[a], z2 = z[b], si = sign * sn[k];
        y[a] = z1 * c[k] - z2 * si;
        y[b] = z2 * c[k] + z1 * si;
    }
    for (i64 e = 2 * s->h; e < s->d; e++) y[e] = z[e];
}

void kiln_qkv_norm_rope_fwd(const float *qkv, const float *qw, const float *kw, const float *cos_t,
                            const float *sin_t, int per_batch, float *out, float *q_rstd, float *k_rstd,
                            i64 b, i64 t, i64 hq, i64 hkv, i64 d, i64 h, int interleaved, float eps, int nt) {
    rope_shape s = {b, t, hq, hkv, d, h, (hq + 2 * hkv) * d, per_batch, interleaved, cos_t, sin_t};
    #pragma omp parallel num_threads(nt)
    {
        float *z = malloc((size_t)d * sizeof(float));
        #pragma omp for schedule(static)
        for (i64 i = 0; i < b * t; i++) {
            i64 row = per_batch ? i : i % t;
            const float *c = cos_t + row * h, *sn = sin_t + row * h;
            for (int part = 0; part < 2; part++) {
                i64 heads = part ? hkv : hq, col0 = part ? hq * d : 0;
                const float *w = part ? kw : qw;
                float *rstd = part ? k_rstd : q_rstd;
                for (i64 hd = 0; hd < heads; hd++) {
                    const float *x = qkv + i * s.f + col0 + hd * d;
                    float r = 1.0f;
                    if (w) {
                        double acc = 0.0;
                        #pragma omp simd reduction(+:acc)
                        for (i64 e = 0; e < d; e++) acc += (double)x[e] * (double)x[e];
                        r = (float)(1.0 / sqrt(acc / (double)d + (double)eps));
                        for (i64 e = 0; e < d; e++) z[e] = (x[e] * r) * w[e];
                    } else {
                        memcpy(z, x, (size_t)d * sizeof(float));
                    }
                    rstd[i * heads + hd] = r;
                    rotate(&s, c, sn, z, out + i * s.f + col0 + hd * d, 1.0f);
                }
            }
            memmove(out + i * s.f + (hq + hkv) * d, qkv + i * s.f + (hq + hkv) * d, (size_t)(hkv * d) * sizeof(float));
        }
        free(z);
    }
}

/* g = the inverse rotation of d_out; then the rmsnorm backward of each head (as kiln_rmsnorm_bwd) when
 * it has a weight, else d_x = g; v's gradient is d_out's v. The weights' gradients sum fixed blocks of
 * rows in order. */
void kiln_qkv_norm_rope_bwd(const float *dy, const float *qkv, const float *qw, const float *kw,
                            const float *cos_t, const float *sin_t, int per_batch, const float *q_rstd,
                            const float *k_rstd, const float *dq_rstd, const float *dk_rstd, float *dqkv,
                            float *dqw, float *dkw, i64 b, i64 t, i64 hq, i64 hkv, i64 d, i64 h,
                            int interleaved, int nt) {
    rope_shape s = {b, t, hq, hkv, d, h, (hq + 2 * hkv) * d, per_batch, interleaved, cos_t, sin_t};
    i64 n = b * t, blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
    double *part = calloc((size_t)(blocks * 2 * d), sizeof(double));
    #pragma omp parallel num_threads(nt)
    {
        float *g = malloc((size_t)d * sizeof(float));
        #pragma omp for schedule(static)
        for (i64 blk = 0; blk < blocks; blk++) {
            i64 end = (blk + 1) * ROW_BLOCK < n ? (blk + 1) * ROW_BLOCK : n;
            for (i64 i = blk * ROW_BLOCK; i < end; i++) {
                i64 row = per_batch ? i : i % t;
                const float *c = cos_t + row * h, *sn = sin_t + row * h;
                for (int which = 0; which < 2; which++) {
                    i64 heads = which ? hkv : hq, col0 = which ? hq * d : 0;
                    const float *w = which ? kw : qw, *rstd = which ? k_rstd : q_rstd;
                    const float *drstd = which ? dk_rstd : dq_rstd;
                    double *pw = part + (blk * 2 + which) * d;
                    for (i64 hd = 0; hd < heads; hd++) {
                        i64 off = i * s.f + col0 + hd * d;
                        const float *x = qkv + off;
                        float *dx = dqkv + off;
                        if (dy) rotate(&s, c, sn, dy + off, g, -1.0f);
                        else memset(g, 0, (size_t)d * sizeof(float));
                        if (!w) { memcpy(dx, g, (size_t)d * sizeof(float)); continue; }
                        float r = rstd[i * heads + hd];
                        double acc = 0.0;
                        #pragma omp simd reduction(+:acc)
                        for (i64 e = 0; e < d; e++) acc += (double)(g[e] * w[e]) * (double)(x[e] * r);
                        float mean = (float)(acc / (double)d);
                        for (i64 e = 0; e < d; e++) {
                            pw[e] += (double)g[e] * (double)(x[e] * r);
                            dx[e] = r * (g[e] * w[e] - (x[e] * r) * mean);
                        }
                        if (drstd) {
                            float k = drstd[i * heads + hd] * r * r * r / (float)d;
                            for (i64 e = 0; e < d; e++) dx[e] -= k * x[e];
                        }
                    }
                }
                float *dv = dqkv + i * s.f + (hq + hkv) * d;
                if (dy) memcpy(dv, dy + i * s.f + (hq + hkv) * d, (size_t)(hkv * d) * sizeof(float));
                else memset(dv, 0, (size_t)(hkv * d) * sizeof(float));
            }
        }
        free(g);
    }
    for (int which = 0; which < 2; which++) {
        float *dw = which ? dkw : dqw;
        for (i64 e = 0; e < d; e++) {
            double acc = 0.0;
            for (i64 blk = 0; blk < blocks; blk++) acc += part[(blk * 2 + which) * d + e];
            dw[e] = (float)acc;
        }
    }
    free(part);
}

/* ---- rope (reference: kiln.core.ops.library._attention.rope_into) --------------------------------
 * Every head (hd floats; heads per row) of x [B, T, heads * hd] rotated by its row's tables (as
 * qkv_qk_norm_rope's rope); sign -1: the inverse rotation (rope's backward). out may be x. */
void kiln_rope(const float *x, const float *cos_t, const float *sin_t, int per_batch, float *out, i64 b, i64 t,
               i64 heads, i64 hd, i64 h, int interleaved, float sign, int nt) {
    rope_shape s = {b, t, heads, 0, hd, h, heads * hd, per_batch, interleaved, cos_t, sin_t};
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < b * t; i++) {
        i64 row = per_batch ? i : i % t;
        const float *c = cos_t + row * h, *sn = sin_t + row * h;
        for (i64 k = 0; k < heads; k++) rotate(&s, c, sn, x + i * s.f + k * hd, out + i * s.f + k * hd, sign);
    }
}

/* ---- layernorm (reference: kiln.core.ops.library._norms) ------------------------------------------
 * mean = mean(x), rstd = 1/sqrt(mean((x - mean)^2) + eps) (biased variance, both sums in double),
 * y = ((x - mean) * rstd) * w (+ bias). */
void kiln_layernorm_fwd(const float *x, const float *w, const float *bias, float *y, float *mean, float *rstd,
                        i64 n, i64 c, float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 i = 0; i < n; i++) {
        const float *xi = x + i * c;
        float *yi = y + i * c;
        double s = 0.0;
        #pragma omp simd reduction(+:s)
        for (i64 j = 0; j < c; j++) s += (double)xi[j];
        float mu = (float)(s / (double)c);
        double v = 0.0;
        #pragma omp simd reduction(+:v)
        for (i64 j = 0; j < c; j++) {
            float d = xi[j] - mu;
            v += (double)d * (double)d;
        }
        float r = (float)(1.0 / sqrt(v / (double)c + (double)eps));
        mean[i] = mu;
        rstd[i] = r;
        if (bias) {
            #pragma omp simd
            for (i64 j = 0; j < c; j++) yi[j] = ((xi[j] - mu) * r) * w[j] + bias[j];
        } else {
            #pragma omp simd
            for (i64 j = 0; j < c; j++) yi[j] = ((xi[j] - mu) * r) * w[j];
        }
    }
}

/* d_x = rstd (g - mean(g) - xhat mean(g xhat)) + d_mean / C - d_rstd rstd^3 (x - mean) / C, g = d_y w,
 * xhat = (x - mean) rstd; d_weight = sum over rows of d_y xhat, d_bias = sum of d_y, each summing fixed
 * blocks of rows in order (in double). d_y, d_mean, d_rstd NULL: absent. */
void kiln_layernorm_bwd(const float *dy, const float *x, const float *mean, const float *rstd, const float *w,
                        const float *dmean, const float *drstd, float *dx, float *dw, float *db, i64 n, i64 c,
                        int nt) {
    i64 blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
    double *part = dy ? (double *)calloc((size_t)(blocks * 2 * c), sizeof(double)) : NULL;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 b = 0; b < blocks; b++) {
        i64 end = (b + 1) * ROW_BLOCK < n ? (b + 1) * ROW_BLOCK : n;
        for (i64 i = b * ROW_BLOCK; i < end; i++) {
            const float *xi = x + i * c;
            float *dxi = dx + i * c, mu = mean[i], r = rstd[i];
            if (dy) {
                const float *dyi = dy + i * c;
                double sg = 0.0, sgx = 0.0;
                #pragma omp simd reduction(+:sg, sgx)
                for (i64 j = 0; j < c; j++) {
                    float g = dyi[j] * w[j];
                    sg += (double)g;
                    sgx += (double)g * (double)((xi[j] - mu) * r);
                }
                float mg = (float)(sg / (double)c), mgx = (float)(sgx / (double)c);
                double *pw = part + b * 2 * c, *pb = pw + c;
                #pragma omp simd
                for (i64 j = 0; j < c; j++) {
                    float xh = (xi[j] - mu) * r;
                    pw[j] += (double)dyi[j] * (double)xh;
                    pb[j] += (double)dyi[j];
                    dxi[j] = r * (dyi[j] * w[j] - mg - xh * mgx);
                }
            } else {
                memset(dxi, 0, (size_t)c * sizeof(float));
            }
            if (dmean) {
                float k = dmean[i] / (float)c;
                #pragma omp simd
                for (i64 j = 0; j < c; j++) dxi[j] += k;
            }
            if (drstd) {
                float k = drstd[i] * r * r * r / (float)c;
                #pragma omp simd
                for (i64 j = 0; j < c; j++) dxi[j] -= k * (xi[j] - mu);
            }
        }
    }
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (i64 j = 0; j < c; j++) {
        double sw = 0.0, sb = 0.0;
        if (part)
            for (i64 b = 0; b < blocks; b++) { sw += part[b * 2 * c + j]; sb += part[b * 2 * c + c + j]; }
        dw[j] = (float)sw;
        db[j] = (float)sb;
    }
    free(part);
}

/* ---- attention (reference: kiln.core.ops.library._attention: flash_attention on packed qkv, attention
 * on separate q, k, v) -----------------------------------------------------------------------------
 * q, k and v are rows of heads (packed qkv's three column ranges, or three arrays); a kv head's rep = Hq / Hkv
 * query heads are stacked into one block of rows so that every load of K and V serves the group.
 * Blocks of rows x 64 keys, an online softmax in the forward, the saved lse in the backward (FlashAttention-2).
 * The block products are register-tiled: 4 rows x 64 columns (or 4 rows x up to 64 of D) in 16-float
 * vectors; D is padded to a multiple of 16 with zeros in the gathered blocks. Multiply-adds may fuse
 * here (the rest of the file keeps NumPy's rounding). */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define KB 64 /* keys per block */

/* KEEP(x): x stays in a vector register (an empty asm that claims to change it), so that the compiler
 * does not fold its load into every multiply-add that uses it */
#if defined(__AVX512F__)  /* a 16-float vector fits one register only with AVX-512: elsewhere (AVX2: two ymm,
                            NEON: four) no constraint names it and the build would fail */
#define KEEP(x) __asm__("" : "+v"(x))
#else
#define KEEP(x) ((void)0)
#endif

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* s[4][16 nv] = a[4][dp] @ bt[dp][16 nv] (a's rows dp apart, bt's ldb, s's KB), nv = 1..4 vectors of keys */
static inline __attribute__((always_inline)) void mk_ab_part(const float *a, const float *bt, i64 ldb, float *s,
                                                             i64 dp, int nv) {
    v16 c[4][4];
    memset(c, 0, sizeof c);
    for (i64 d = 0; d < dp; d++) {
        const float *row = bt + d * ldb;
        v16 b[4];
        for (int k = 0; k < nv; k++) {
            b[k] = ld(row + 16 * k);
            KEEP(b[k]);  /* else each product reloads them from L1 */
        }
        for (int r = 0; r < 4; r++) {
            float x = a[r * dp + d];
            for (int k = 0; k < nv; k++) c[r][k] += x * b[k];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < nv; k++) st(s + r * KB + 16 * k, c[r][k]);
}

/* the scores of 4 rows against the first nk <= KB keys of a block, rounded up to 16; the columns past
 * them keep what they held (the caller masks them) */
static void mk_ab(const float *a, const float *bt, i64 ldb, float *s, i64 dp, i64 nk) {
    switch ((nk + 15) / 16) {
    case 4: mk_ab_part(a, bt, ldb, s, dp, 4); break;
    case 3: mk_ab_part(a, bt, ldb, s, dp, 3); break;
    case 2: mk_ab_part(a, bt, ldb, s, dp, 2); break;
    case 1: mk_ab_part(a, bt, ldb, s, dp, 1); break;
    default: break;
    }
}

/* acc[4][dp] += p[4][kn] @ v[kn][dp] (p's rows KB apart), nv = 1..4 vectors of D from column d0 */
static inline __attribute__((always_inline)) void mk_pv_part(const float *p, const float *v, float *acc,
                                                             i64 dp, i64 kn, i64 d0, int nv) {
    v16 c[4][4];
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < nv; k++) c[r][k] = ld(acc + r * dp + d0 + 16 * k);
    for (i64 j = 0; j < kn; j++) {
        v16 b[4];
        for (int k = 0; k < nv; k++) {
            b[k] = ld(v + j * dp + d0 + 16 * k);
            KEEP(b[k]);
        }
        for (int r = 0; r < 4; r++) {
            float x = p[r * KB + j];
            for (int k = 0; k < nv; k++) c[r][k] += x * b[k];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < nv; k++) st(acc + r * dp + d0 + 16 * k, c[r][k]);
}

static void mk_pv(const float *p, const float *v, float *acc, i64 dp, i64 kn) {
    i64 d0 = 0;
    for (; d0 + 64 <= dp; d0 += 64) mk_pv_part(p, v, acc, dp, kn, d0, 4);
    switch ((dp - d0) / 16) {
    case 3: mk_pv_part(p, v, acc, dp, kn, d0, 3); break;
    case 2: mk_pv_part(p, v, acc, dp, kn, d0, 2); break;
    case 1: mk_pv_part(p, v, acc, dp, kn, d0, 1); break;
    default: break;
    }
}

/* out[kn][dp] += p[4][kn]^T @ a[4][dp] (p's rows KB apart, a's dp apart) */
static inline __attribute__((always_inline)) void mk_tn_part(const float *p, const float *a, float *out,
                                                             i64 dp, i64 kn, i64 d0, int nv) {
    v16 q[4][4];
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < nv; k++) q[r][k] = ld(a + r * dp + d0 + 16 * k);
    for (i64 j = 0; j < kn; j++) {
        v16 c[4];
        for (int k = 0; k < nv; k++) c[k] = ld(out + j * dp + d0 + 16 * k);
        for (int r = 0; r < 4; r++) {
            float x = p[r * KB + j];
            for (int k = 0; k < nv; k++) c[k] += x * q[r][k];
        }
        for (int k = 0; k < nv; k++) st(out + j * dp + d0 + 16 * k, c[k]);
    }
}

static void mk_tn(const float *p, const float *a, float *out, i64 dp, i64 kn) {
    i64 d0 = 0;
    for (; d0 + 64 <= dp; d0 += 64) mk_tn_part(p, a, out, dp, kn, d0, 4);
    switch ((dp - d0) / 16) {
    case 3: mk_tn_part(p, a, out, dp, kn, d0, 3); break;
    case 2: mk_tn_part(p, a, out, dp, kn, d0, 2); break;
    case 1: mk_tn_part(p, a, out, dp, kn, d0, 1); break;
    default: break;
    }
}

/* rows of a [B, T, H * D] tensor (the heads of a row D apart, a head's D floats contiguous): its base and
 * the floats between sequences (bs) and between positions (rs); packed qkv's q, k and v are three such
 * views of one array, separate q, k and v (or views of one) three arrays */
typedef struct {
    const float *p;
    i64 bs, rs;
} rows_t;

typedef struct {
    float *p;
    i64 bs, rs;
} wrows_t;

typedef struct {
    i64 b, tq, tk, off, hq, hkv, d, dp, rep, qp; /* off = Tk - Tq: query i sits at key position i + off;
                                                    qp: query positions per block of rows (rep * qp rows) */
    int causal;
    i64 window;        /* 0: none */
    const int32_t *seg; /* [B, Tk] or NULL */
} attn_shape;

/* scores of the query at key position p against keys [k0, k0 + KB) that it does not see set to -inf:
 * keys outside [p - window + 1, p] (causal) or (p - window, p + window) (not), other segments, the
 * padding past kn (the reference's _keep and _segment_keep) */
static void mask_row(const attn_shape *s, i64 b, i64 p, i64 k0, i64 kn, float *x) {
    i64 lo = s->window ? p - s->window + 1 - k0 : 0;
    i64 hi = s->causal ? p + 1 - k0 : (s->window ? p + s->window - k0 : kn);
    if (hi > kn) hi = kn;
    for (i64 j = 0; j < KB; j++)
        if (j < lo || j >= hi) x[j] = -INFINITY;
    if (s->seg) {
        const int32_t *seg = s->seg + b * s->tk, mine = seg[p];
        for (i64 j = 0; j < kn; j++)
            if (seg[k0 + j] != mine) x[j] = -INFINITY;
    }
}

/* the keys [lo, hi) query rows [t0, t1) may see: none before lo, none from hi (causal and window);
 * lo rounded down to a block of keys; hi <= lo: none */
static inline void key_range(const attn_shape *s, i64 t0, i64 t1, i64 *lo, i64 *hi) {
    i64 p0 = t0 + s->off, p1 = t1 + s->off;
    *lo = 0;
    *hi = s->tk;
    if (s->causal && p1 < *hi) *hi = p1;
    if (s->window) {
        i64 first = p0 - s->window + 1;
        *lo = first > 0 ? first : 0;
        if (!s->causal && p1 - 1 + s->window < *hi) *hi = p1 - 1 + s->window;
    }
    if (*hi < 0) *hi = 0;
    *lo = (*lo / KB) * KB;
}

/* how many of the block's kn keys from k0 the rows r..r + 3 of a block of rows may see: causal, those up
 * to the group's last position (the diagonal's blocks are triangles: a group of rows skips the keys
 * that none of its rows sees); else all kn. The scores, probabilities and products past it are skipped:
 * their probabilities would be exp(-inf) = 0. */
static inline i64 group_keys(const attn_shape *s, i64 t0, i64 n, i64 rows, i64 r, i64 k0, i64 kn) {
    if (!s->causal) return kn;
    i64 seen = 0;
    for (i64 i = r; i < r + 4 && i < rows; i++) {
        i64 v = t0 + i % n + s->off + 1 - k0;
        seen = v > seen ? v : seen;
    }
    return seen < kn ? seen : kn;
}

/* whether a block needs its mask applied (else every pair in it is kept) */
static inline int block_masked(const attn_shape *s, i64 t0, i64 t1, i64 k0, i64 k1) {
    i64 p0 = t0 + s->off, p1 = t1 + s->off;
    if (s->seg || k1 - k0 < KB) return 1;
    if (s->causal && k1 - 1 > p0) return 1;
    if (s->window && (k0 <= p1 - 1 - s->window || (!s->causal && k1 - 1 >= p0 + s->window))) return 1;
    return 0;
}

/* rows of one block: row r is query head (g rep + r / n) at position t0 + r % n (n positions) */
static void gather_rows(rows_t x, i64 col0, const attn_shape *s, i64 b, i64 t0, i64 n, float factor,
                        float *dst) {
    for (i64 r = 0; r < s->rep * n; r++) {
        const float *src = x.p + b * x.bs + (t0 + r % n) * x.rs + col0 + (r / n) * s->d;
        float *y = dst + r * s->dp;
        for (i64 j = 0; j < s->d; j++) y[j] = src[j] * factor;
    }
}

/* the Tk keys of kv head g of sequence b: transposed (kt[dp][tp]) and/or as rows (kr[tp][dp]), zero
 * past Tk (tp: Tk rounded up to KB) and past D */
static void gather_keys(rows_t x, const attn_shape *s, i64 b, i64 g, i64 tp, float *kt, float *kr) {
    if (kt) memset(kt, 0, (size_t)(s->dp * tp) * sizeof(float));
    if (kr) memset(kr, 0, (size_t)(s->dp * tp) * sizeof(float));
    const float *base = x.p + b * x.bs + g * s->d;
    if (kr)
        for (i64 j = 0; j < s->tk; j++) memcpy(kr + j * s->dp, base + j * x.rs, (size_t)s->d * sizeof(float));
    if (kt)  /* transposed 16 keys at a time: the 16 source rows stay in L1 while their columns go out */
        for (i64 j0 = 0; j0 < s->tk; j0 += 16) {
            i64 jn = s->tk - j0 < 16 ? s->tk - j0 : 16;
            for (i64 e = 0; e < s->d; e++) {
                float *y = kt + e * tp + j0;
                const float *src = base + j0 * x.rs + e;
                for (i64 j = 0; j < jn; j++) y[j] = src[j * x.rs];
            }
        }
}

static void *zalloc(i64 floats) { return calloc((size_t)floats, sizeof(float)); }

static attn_shape make_shape(i64 b, i64 tq, i64 tk, i64 hq, i64 hkv, i64 d, int causal, i64 window,
                             const int32_t *seg) {
    attn_shape s = {b, tq, tk, tk - tq, hq, hkv, d, (d + 15) / 16 * 16, hq / hkv, 0, causal, window, seg};
    s.qp = KB / s.rep > 0 ? KB / s.rep : 1;
    return s;
}

/* o and lse ([B, Hq, Tq], contiguous) of q over k and v; one (sequence, kv head) per work item */
static void attn_fwd(rows_t qx, rows_t kx, rows_t vx, wrows_t ox, float *lse, attn_shape s, float scale, int nt) {
    i64 blocks = (s.tq + s.qp - 1) / s.qp, items = s.b * s.hkv, tp = (s.tk + KB - 1) / KB * KB;
    i64 rows4 = (s.rep * s.qp + 3) / 4 * 4;
    #pragma omp parallel num_threads(nt)
    {
        float *q = zalloc(rows4 * s.dp), *kt = zalloc(s.dp * tp), *vr = zalloc(s.dp * tp);
        float *sc = zalloc(rows4 * KB), *acc = zalloc(rows4 * s.dp), *m = zalloc(rows4), *l = zalloc(rows4);
        #pragma omp for schedule(dynamic, 1)
        for (i64 it = 0; it < items; it++) {
            i64 b = it / s.hkv, g = it % s.hkv;
            gather_keys(kx, &s, b, g, tp, kt, NULL);
            gather_keys(vx, &s, b, g, tp, NULL, vr);
            for (i64 qb = 0; qb < blocks; qb++) {
                i64 t0 = qb * s.qp, t1 = t0 + s.qp < s.tq ? t0 + s.qp : s.tq, n = t1 - t0;
                i64 rows = s.rep * n, r4 = (rows + 3) / 4 * 4;
                memset(q, 0, (size_t)(r4 * s.dp) * sizeof(float));
                gather_rows(qx, g * s.rep * s.d, &s, b, t0, n, scale, q);
                memset(acc, 0, (size_t)(r4 * s.dp) * sizeof(float));
                memset(sc, 0, (size_t)(r4 * KB) * sizeof(float));  /* padding rows stay 0 */
                for (i64 r = 0; r < r4; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
                i64 lo, hi;
                key_range(&s, t0, t1, &lo, &hi);
                for (i64 k0 = lo; k0 < hi; k0 += KB) {
                    i64 k1 = k0 + KB < hi ? k0 + KB : hi, kn = k1 - k0;
                    for (i64 r = 0; r < r4; r += 4)
                        mk_ab(q + r * s.dp, kt + k0, tp, sc + r * KB, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                    int masked = block_masked(&s, t0, t1, k0, k1);
                    for (i64 r = 0; r < rows; r++) {
                        float *x = sc + r * KB;
                        if (masked) mask_row(&s, b, t0 + r % n + s.off, k0, kn, x);
                        float mx = -INFINITY;
                        #pragma omp simd reduction(max:mx)
                        for (i64 j = 0; j < KB; j++) mx = x[j] > mx ? x[j] : mx;
                        float m_new = mx > m[r] ? mx : m[r];
                        if (m_new == -INFINITY) { memset(x, 0, KB * sizeof(float)); continue; }
                        float alpha = exp_f(m[r] - m_new), sum = 0.0f;
                        #pragma omp simd reduction(+:sum)
                        for (i64 j = 0; j < KB; j++) { x[j] = exp_f(x[j] - m_new); sum += x[j]; }
                        l[r] = l[r] * alpha + sum;
                        m[r] = m_new;
                        if (alpha != 1.0f)
                            for (i64 e = 0; e < s.dp; e++) acc[r * s.dp + e] *= alpha;
                    }
                    for (i64 r = 0; r < r4; r += 4)
                        mk_pv(sc + r * KB, vr + k0 * s.dp, acc + r * s.dp, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                }
                for (i64 r = 0; r < rows; r++) {
                    i64 h = g * s.rep + r / n, p = t0 + r % n;
                    float *y = ox.p + b * ox.bs + p * ox.rs + h * s.d, inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
                    for (i64 e = 0; e < s.d; e++) y[e] = acc[r * s.dp + e] * inv;
                    lse[(b * s.hq + h) * s.tq + p] = l[r] > 0 ? m[r] + logf(l[r]) : INFINITY;
                }
            }
        }
        free(q); free(kt); free(vr); free(sc); free(acc); free(m); free(l);
    }
}

/* dS = P (dP - rowsum(dO O) + d_lse), P = exp(S - lse); dQ = scale dS K, dK = dS^T (scale Q), dV = P^T dO.
 * One (sequence, kv head) per work item: its dK and dV sum over every query block in order. */
static void attn_bwd(rows_t dox, rows_t qx, rows_t kx, rows_t vx, rows_t ox, const float *lse, const float *dlse,
                     wrows_t dqx, wrows_t dkx, wrows_t dvx, attn_shape s, float scale, int nt) {
    i64 blocks = (s.tq + s.qp - 1) / s.qp, items = s.b * s.hkv, tp = (s.tk + KB - 1) / KB * KB;
    i64 rows4 = (s.rep * s.qp + 3) / 4 * 4;
    #pragma omp parallel num_threads(nt)
    {
        float *q = zalloc(rows4 * s.dp), *dor = zalloc(rows4 * s.dp), *dq = zalloc(rows4 * s.dp);
        float *kt = zalloc(s.dp * tp), *kr = zalloc(s.dp * tp), *vt = zalloc(s.dp * tp);
        float *p = zalloc(rows4 * KB), *ds = zalloc(rows4 * KB), *lr = zalloc(rows4), *shift = zalloc(rows4);
        float *dk = zalloc(tp * s.dp), *dv = zalloc(tp * s.dp);
        #pragma omp for schedule(dynamic, 1)
        for (i64 it = 0; it < items; it++) {
            i64 b = it / s.hkv, g = it % s.hkv;
            gather_keys(kx, &s, b, g, tp, kt, kr);
            gather_keys(vx, &s, b, g, tp, vt, NULL);
            memset(dk, 0, (size_t)(tp * s.dp) * sizeof(float));
            memset(dv, 0, (size_t)(tp * s.dp) * sizeof(float));
            for (i64 qb = 0; qb < blocks; qb++) {
                i64 t0 = qb * s.qp, t1 = t0 + s.qp < s.tq ? t0 + s.qp : s.tq, n = t1 - t0;
                i64 rows = s.rep * n, r4 = (rows + 3) / 4 * 4;
                memset(q, 0, (size_t)(r4 * s.dp) * sizeof(float));
                memset(dor, 0, (size_t)(r4 * s.dp) * sizeof(float));
                memset(dq, 0, (size_t)(r4 * s.dp) * sizeof(float));
                gather_rows(qx, g * s.rep * s.d, &s, b, t0, n, scale, q);
                if (dox.p) gather_rows(dox, g * s.rep * s.d, &s, b, t0, n, 1.0f, dor);
                for (i64 r = 0; r < r4; r++) {
                    lr[r] = INFINITY;  /* padding rows: P = 0 */
                    shift[r] = 0.0f;
                    if (r >= rows) continue;
                    i64 h = g * s.rep + r / n, pos = t0 + r % n;
                    lr[r] = lse[(b * s.hq + h) * s.tq + pos];
                    float sh = dlse ? dlse[(b * s.hq + h) * s.tq + pos] : 0.0f;
                    if (dox.p) {
                        const float *orow = ox.p + b * ox.bs + pos * ox.rs + h * s.d;
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (i64 e = 0; e < s.d; e++) dot += dor[r * s.dp + e] * orow[e];
                        sh -= dot;
                    }
                    shift[r] = sh;
                }
                i64 lo, hi;
                key_range(&s, t0, t1, &lo, &hi);
                for (i64 k0 = lo; k0 < hi; k0 += KB) {
                    i64 k1 = k0 + KB < hi ? k0 + KB : hi, kn = k1 - k0;
                    for (i64 r = 0; r < r4; r += 4)
                        mk_ab(q + r * s.dp, kt + k0, tp, p + r * KB, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                    int masked = block_masked(&s, t0, t1, k0, k1);
                    for (i64 r = 0; r < r4; r++) {
                        float *x = p + r * KB, lv = lr[r];
                        if (masked && r < rows) mask_row(&s, b, t0 + r % n + s.off, k0, kn, x);
                        #pragma omp simd
                        for (i64 j = 0; j < KB; j++) x[j] = exp_f(x[j] - lv);
                    }
                    if (dox.p) {
                        for (i64 r = 0; r < r4; r += 4)
                            mk_tn(p + r * KB, dor + r * s.dp, dv + k0 * s.dp, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                        for (i64 r = 0; r < r4; r += 4)
                            mk_ab(dor + r * s.dp, vt + k0, tp, ds + r * KB, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                    } else {
                        memset(ds, 0, (size_t)(r4 * KB) * sizeof(float));
                    }
                    for (i64 r = 0; r < r4; r++) {
                        float sh = shift[r], *x = ds + r * KB, *pr = p + r * KB;
                        #pragma omp simd
                        for (i64 j = 0; j < KB; j++) x[j] = pr[j] * (x[j] + sh);
                    }
                    for (i64 r = 0; r < r4; r += 4)
                        mk_pv(ds + r * KB, kr + k0 * s.dp, dq + r * s.dp, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                    for (i64 r = 0; r < r4; r += 4)
                        mk_tn(ds + r * KB, q + r * s.dp, dk + k0 * s.dp, s.dp, group_keys(&s, t0, n, rows, r, k0, kn));
                }
                for (i64 r = 0; r < rows; r++) {
                    i64 h = g * s.rep + r / n, pos = t0 + r % n;
                    float *y = dqx.p + b * dqx.bs + pos * dqx.rs + h * s.d;
                    for (i64 e = 0; e < s.d; e++) y[e] = dq[r * s.dp + e] * scale;
                }
            }
            for (i64 j = 0; j < s.tk; j++) {
                memcpy(dkx.p + b * dkx.bs + j * dkx.rs + g * s.d, dk + j * s.dp, (size_t)s.d * sizeof(float));
                memcpy(dvx.p + b * dvx.bs + j * dvx.rs + g * s.d, dv + j * s.dp, (size_t)s.d * sizeof(float));
            }
        }
        free(q); free(dor); free(dq); free(kt); free(kr); free(vt); free(p); free(ds); free(lr); free(shift);
        free(dk); free(dv);
    }
}

/* flash_attention on packed qkv rows [q heads | k heads | v heads] (F = (Hq + 2 Hkv) D floats) */
void kiln_flash_fwd(const float *qkv, float *o, float *lse, i64 b, i64 t, i64 hq, i64 hkv, i64 d,
                    int causal, i64 window, const int32_t *seg, float scale, int nt) {
    i64 f = (hq + 2 * hkv) * d;
    rows_t q = {qkv, t * f, f}, k = {qkv + hq * d, t * f, f}, v = {qkv + (hq + hkv) * d, t * f, f};
    wrows_t ox = {o, t * hq * d, hq * d};
    attn_fwd(q, k, v, ox, lse, make_shape(b, t, t, hq, hkv, d, causal, window, seg), scale, nt);
}

void kiln_flash_bwd(const float *dout, const float *qkv, const float *o, const float *lse, const float *dlse,
                    float *dqkv, i64 b, i64 t, i64 hq, i64 hkv, i64 d, int causal, i64 window,
                    const int32_t *seg, float scale, int nt) {
    i64 f = (hq + 2 * hkv) * d, hd = hq * d;
    rows_t q = {qkv, t * f, f}, k = {qkv + hq * d, t * f, f}, v = {qkv + (hq + hkv) * d, t * f, f};
    rows_t dox = {dout, t * hd, hd}, ox = {o, t * hd, hd};
    wrows_t dq = {dqkv, t * f, f}, dk = {dqkv + hq * d, t * f, f}, dv = {dqkv + (hq + hkv) * d, t * f, f};
    attn_bwd(dox, q, k, v, ox, lse, dlse, dq, dk, dv, make_shape(b, t, t, hq, hkv, d, causal, window, seg),
             scale, nt);
}

/* attention on separate q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D] (and o, d_out, dq, dk, dv), each with
 * its own sequence and position strides st[2 i], st[2 i + 1] in floats (q, k, v, o, then d_out, dq, dk,
 * dv); query i sits at key position i + Tk - Tq (the reference's bottom-right alignment) */
void kiln_attention_fwd(const float *q, const float *k, const float *v, float *o, float *lse, const i64 *st,
                        i64 b, i64 tq, i64 tk, i64 hq, i64 hkv, i64 d, int causal, i64 window,
                        const int32_t *seg, float scale, int nt) {
    rows_t qx = {q, st[0], st[1]}, kx = {k, st[2], st[3]}, vx = {v, st[4], st[5]};
    wrows_t ox = {o, st[6], st[7]};
    attn_fwd(qx, kx, vx, ox, lse, make_shape(b, tq, tk, hq, hkv, d, causal, window, seg), scale, nt);
}

void kiln_attention_bwd(const float *dout, const float *q, const float *k, const float *v, const float *o,
                        const float *lse, const float *dlse, float *dq, float *dk, float *dv, const i64 *st,
                        i64 b, i64 tq, i64 tk, i64 hq, i64 hkv, i64 d, int causal, i64 window,
                        const int32_t *seg, float scale, int nt) {
    rows_t qx = {q, st[0], st[1]}, kx = {k, st[2], st[3]}, vx = {v, st[4], st[5]}, ox = {o, st[6], st[7]};
    rows_t dox = {dout, st[8], st[9]};
    wrows_t dqx = {dq, st[10], st[11]}, dkx = {dk, st[12], st[13]}, dvx = {dv, st[14], st[15]};
    attn_bwd(dox, qx, kx, vx, ox, lse, dlse, dqx, dkx, dvx, make_shape(b, tq, tk, hq, hkv, d, causal, window, seg),
             scale, nt);
}
