// Rotary position embedding (kiln.core ops/library/_attention.py rope): x is [B, T, H * D]; the first
// rotary_dim dims of each head rotate in pairs (j, j + half), half = rotary_dim / 2:
// [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin] (sin negated for the inverse); the rest is copied.
// interleaved: the pairs are (2j, 2j + 1) instead (GPT-J).
// cos and sin come from freqs [MaxSeq, half, 2] when given, else angle = pos * theta^(-2j / rotary_dim).
// One thread per (b, t, h, k), k < half rotating a pair and k >= half copying dim rotary_dim + k - half:
// grid-stride over B * T * H * (D - half). out may be x's own storage.
#include "bf16.cuh"
#include "rope.cuh"

extern "C" __global__ void rope_f32(const float* x, const float* freqs, const int* position_ids, float* out,
                                    int B, int T, int H, int D, int rotary_dim, int pos_batched, float theta,
                                    int inverse, int interleaved) {
    int half = rotary_dim / 2, work = D - half;
    long long total = (long long)B * T * H * work;
    for (long long i = first_index(); i < total; i += grid_stride()) {
        int k = i % work;
        long long head = i / work;  // (b * T + t) * H + h
        long long bt = head / H;
        long long base = head * D;
        if (k >= half) {
            out[base + rotary_dim + k - half] = x[base + rotary_dim + k - half];
            continue;
        }
        int t = bt % T;
        int pos = position_ids[pos_batched ? bt : t];
        float c, s;
        rope_cos_sin(freqs, pos, k, half, rotary_dim, theta, &c, &s);
        if (inverse) s = -s;
        int k1 = interleaved ? 2 * k : k, k2 = interleaved ? 2 * k + 1 : half + k;
        float x1 = x[base + k1], x2 = x[base + k2];
        out[base + k1] = x1 * c - x2 * s;
        out[base + k2] = x2 * c + x1 * s;
    }
}

// rope_freqs (kiln.core ops/library/_rope_freqs.py): the table [rows, half, 2] of (cos, sin) of the float32
// angle p * inv_freq[j] (a float32 product, as transformers), each evaluated in double and rounded once,
// times the kind's attention scaling. inv_freq [half] is computed on the host by the op's own function
// (a few values that depend only on the attributes). One thread per (p, j), grid-stride.
extern "C" __global__ void rope_freqs_f32(const float* inv_freq, float* out, long long rows, int half,
                                          float scaling) {
    long long n = rows * half;
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float angle = (float)(i / half) * inv_freq[i % half];
        float c = (float)cos((double)angle), s = (float)sin((double)angle);
        if (scaling != 1.0f) {
            c *= scaling;
            s *= scaling;
        }
        out[2 * i] = c;
        out[2 * i + 1] = s;
    }
}

// qkv_qk_norm_rope under the bf16 recipe on a bf16 qkv, in one pass and without widened copies (NumPy's
// qkv_qk_norm_rope_bf16): each q and k head with a weight becomes u = bf16(x rstd) w (HF's RMSNorm casts to
// the input dtype before the fp32 weight), rstd = 1 / sqrt(mean(x^2) + eps) stored; rope then rotates u in
// fp32 as qkv_norm_rope_f32 rotates it. Heads without a weight keep u = x (rstd 1), v heads are copied. Lane
// l holds dims l, l + 32, ... and computes its partners' u itself, so out is never qkv's storage. TO is the
// element type of out; the rstds are float32 statistics (never rounded). Grid (Hq + 2 Hkv, T, B), 32 threads.
__device__ __forceinline__ float qk_normed(const bf16* x, const float* w, int d, float r) {
    float v = load_f32(x, d);
    return w ? round_bf16(v * r) * w[d] : v;
}

template <typename TO>
__device__ void qkv_norm_rope_rp(const bf16* qkv, const float* q_weight, const float* k_weight, const float* freqs,
                                 const int* position_ids, TO* out, float* q_rstd, float* k_rstd, int T, int Hq, int Hkv,
                                 int D, int rotary_dim, int pos_batched, float eps, float theta, int interleaved) {
    int hd = blockIdx.x, t = blockIdx.y, half = rotary_dim / 2;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    const bf16* x = qkv + (b * T + t) * F + (long long)hd * D;
    long long at = (b * T + t) * F + (long long)hd * D;
    if (hd >= Hq + Hkv) {
        for (int d = threadIdx.x; d < D; d += 32) store_f32(out, at + d, load_f32(x, d));
        return;
    }
    const float* w = hd < Hq ? q_weight : k_weight;
    float r = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (int d = threadIdx.x; d < D; d += 32) ss += load_f32(x, d) * load_f32(x, d);
        r = 1.0f / sqrtf(warp_sum(ss) / D + eps);
    }
    int pos = position_ids[pos_batched ? b * T + t : t];
    for (int d = threadIdx.x; d < D; d += 32) {
        float u = qk_normed(x, w, d, r);
        if (d < 2 * half) {
            int k;
            bool first;
            int p = rope_partner(d, half, interleaved, &k, &first);
            float c, s;
            rope_cos_sin(freqs, pos, k, half, rotary_dim, theta, &c, &s);
            store_f32(out, at + d, u * c + qk_normed(x, w, p, r) * (first ? -s : s));
        } else {
            store_f32(out, at + d, u);
        }
    }
    if (threadIdx.x == 0) {
        if (hd < Hq && q_rstd) q_rstd[(b * T + t) * Hq + hd] = r;
        if (hd >= Hq && k_rstd) k_rstd[(b * T + t) * Hkv + hd - Hq] = r;
    }
}

// float32 out and rstds (null rstds are not written)
extern "C" __global__ void qkv_norm_rope_rp_bf16in(const bf16* qkv, const float* q_weight, const float* k_weight,
                                                   const float* freqs, const int* position_ids, float* out,
                                                   float* q_rstd, float* k_rstd, int T, int Hq, int Hkv, int D,
                                                   int rotary_dim, int pos_batched, float eps, float theta,
                                                   int interleaved) {
    qkv_norm_rope_rp(qkv, q_weight, k_weight, freqs, position_ids, out, q_rstd, k_rstd, T, Hq, Hkv, D, rotary_dim,
                     pos_batched, eps, theta, interleaved);
}

// bf16 out, rounded to nearest even as it is stored; float32 rstds
extern "C" __global__ void qkv_norm_rope_rp_bf16io(const bf16* qkv, const float* q_weight, const float* k_weight,
                                                   const float* freqs, const int* position_ids, bf16* out,
                                                   float* q_rstd, float* k_rstd, int T, int Hq, int Hkv, int D,
                                                   int rotary_dim, int pos_batched, float eps, float theta,
                                                   int interleaved) {
    qkv_norm_rope_rp(qkv, q_weight, k_weight, freqs, position_ids, out, q_rstd, k_rstd, T, Hq, Hkv, D, rotary_dim,
                     pos_batched, eps, theta, interleaved);
}

// The gradient at dim d of a head before its rotation: the inverse rotation of dy (attention.cu's unrotate).
__device__ __forceinline__ float rope_unrotate(const float* dy, int d, int half, const float* freqs, int pos,
                                               int rotary_dim, float theta, int interleaved) {
    if (d >= 2 * half) return dy[d];
    int k;
    bool first;
    int p = rope_partner(d, half, interleaved, &k, &first);
    float c, s;
    rope_cos_sin(freqs, pos, k, half, rotary_dim, theta, &c, &s);
    return first ? dy[d] * c + dy[p] * s : dy[d] * c - dy[p] * s;
}

// at most this many dims per lane (D <= 256, as kiln.cuda._ops._heads checks)
constexpr int QK_PER_LANE = 8;

// Its backward (NumPy's qkv_qk_norm_rope_backward_bf16) on a bf16 qkv, in one pass: g = the inverse rotation of
// d_out (float32); a q or k head with a weight: d_u = bf16(g w), d_x = rstd (d_u - u mean(d_u u)) -
// d_rstd rstd^3 x / D with u = x rstd; other heads pass g (v heads: d_out as is); every d_x rounded to bf16.
// d_out and d_*_rstd may be null. Grid (Hq + 2 Hkv, T, B), 32 threads.
extern "C" __global__ void qkv_norm_rope_backward_rp_bf16in(const float* d_out, const bf16* qkv,
                                                            const float* q_weight, const float* k_weight,
                                                            const float* freqs, const int* position_ids,
                                                            const float* q_rstd, const float* k_rstd,
                                                            const float* d_q_rstd, const float* d_k_rstd,
                                                            float* d_qkv, int T, int Hq, int Hkv, int D,
                                                            int rotary_dim, int pos_batched, float theta,
                                                            int interleaved) {
    int hd = blockIdx.x, t = blockIdx.y, half = rotary_dim / 2;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D, at = (b * T + t) * F + (long long)hd * D;
    bool is_q = hd < Hq, is_k = !is_q && hd < Hq + Hkv;
    const float* w = is_q ? q_weight : is_k ? k_weight : nullptr;
    const float* dy = d_out ? d_out + at : nullptr;
    const bf16* x = qkv + at;
    float* dx = d_qkv + at;
    int pos = position_ids[pos_batched ? b * T + t : t];
    if (!w) {
        for (int d = threadIdx.x; d < D; d += 32) {
            float g = !dy ? 0.0f : is_q || is_k ? rope_unrotate(dy, d, half, freqs, pos, rotary_dim, theta, interleaved)
                                                : dy[d];
            dx[d] = round_bf16(g);
        }
        return;
    }
    long long stat = is_q ? (b * T + t) * Hq + hd : (b * T + t) * Hkv + hd - Hq;
    float r = (is_q ? q_rstd : k_rstd)[stat];
    const float* d_rstd = is_q ? d_q_rstd : d_k_rstd;
    float du[QK_PER_LANE], dot = 0.0f;
    for (int u = 0, d = threadIdx.x; d < D; ++u, d += 32) {
        float g = dy ? rope_unrotate(dy, d, half, freqs, pos, rotary_dim, theta, interleaved) : 0.0f;
        du[u] = round_bf16(g * w[d]);
        dot += du[u] * (load_f32(x, d) * r);
    }
    dot = warp_sum(dot) / D;
    float dr = d_rstd ? d_rstd[stat] * r * r * r / D : 0.0f;
    for (int u = 0, d = threadIdx.x; d < D; ++u, d += 32) {
        float xv = load_f32(x, d);
        dx[d] = round_bf16(r * (du[u] - (xv * r) * dot) - dr * xv);
    }
}

// The norm weights' gradients of it: d_w[d] = sum over rows of g_d bf16(x_d rstd), g the inverse rotation of
// d_out; q heads (blockIdx.y = 0) and k heads (1), rows in order. Grid (cdiv(D, 32), 2), 32 threads; a null
// gradient is not written.
extern "C" __global__ void qkv_norm_rope_backward_dw_rp_bf16in(const float* d_out, const bf16* qkv,
                                                               const float* freqs, const int* position_ids,
                                                               const float* q_rstd, const float* k_rstd,
                                                               float* d_q_weight, float* d_k_weight, int B, int T,
                                                               int Hq, int Hkv, int D, int rotary_dim,
                                                               int pos_batched, float theta, int interleaved) {
    int d = blockIdx.x * 32 + threadIdx.x, half = rotary_dim / 2;
    bool is_q = blockIdx.y == 0;
    float* dw = is_q ? d_q_weight : d_k_weight;
    if (d >= D || !dw) return;
    int heads = is_q ? Hq : Hkv, first = is_q ? 0 : Hq;
    const float* rstd = is_q ? q_rstd : k_rstd;
    long long F = (long long)(Hq + 2 * Hkv) * D;
    float acc = 0.0f;
    for (long long bt = 0; bt < (long long)B * T; ++bt) {
        int pos = position_ids[pos_batched ? bt : bt % T];
        for (int h = 0; h < heads; ++h) {
            long long base = bt * F + (long long)(first + h) * D;
            float g = d_out ? rope_unrotate(d_out + base, d, half, freqs, pos, rotary_dim, theta, interleaved) : 0.0f;
            acc += g * round_bf16(load_f32(qkv, base + d) * rstd[bt * heads + h]);
        }
    }
    dw[d] = acc;
}
