// Attention on packed qkv [B, T, (Hq + 2 Hkv) * D] (kiln.core ops/library/_attention.py flash_attention,
// flash_attention_backward, qkv_qk_norm_rope and its backward): the SIMT variant. One warp (32 threads)
// per row: lane l holds dims l, l + 32, ... (D <= 32 * PER_LANE); dot products are warp sums. Query head h
// reads kv head h / (Hq / Hkv) (GQA). Key j is visible from query i when causal => j <= i, a window w > 0
// => i - w < j (and j < i + w when not causal), and segment ids (when given) are equal. Scores are scaled,
// then capped (softcap > 0) and biased by ALiBi (alibi != 0), as attention's reference does.
// Sums run over keys (and, for dk and dv, over queries) in index order: deterministic, no atomics.
#include "bf16.cuh"
#include "rope.cuh"

constexpr int PER_LANE = 8;

__device__ __forceinline__ bool visible(int i, int j, int causal, int window, const int* seg, long long b, int T) {
    if (causal && j > i) return false;
    if (window > 0 && (j <= i - window || (!causal && j >= i + window))) return false;
    return !seg || seg[b * T + i] == seg[b * T + j];
}

// The logit of query i and key j from the scaled score s: capped (c tanh(s / c), when softcap > 0), then
// ALiBi's bias (-slope |i - j|); *th = tanh(s / c) for the cap's derivative 1 - th^2.
__device__ __forceinline__ float logit(float s, float softcap, float slope, int i, int j, float* th) {
    *th = 0.0f;
    if (softcap > 0.0f) {
        *th = tanhf(s / softcap);
        s = softcap * *th;
    }
    return s - slope * fabsf((float)(i - j));
}

__device__ __forceinline__ float row_dot(const float* a, const float* b, int D) {
    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += 32) s += a[d] * b[d];
    return warp_sum(s);
}

// flash_attention: out[b, i, h] = sum_j softmax_j(scale q_i . k_j) v_j over visible keys (online softmax);
// lse[b, h, i] = log-sum-exp of the scores (+inf, and out = 0, for a row that sees no key).
// Grid (T, Hq, B), 32 threads.
extern "C" __global__ void flash_attention_f32(const float* qkv, const int* seg, float* out, float* lse, int T,
                                               int Hq, int Hkv, int D, int causal, int window, float scale,
                                               float softcap, int alibi) {
    int i = blockIdx.x, h = blockIdx.y;
    float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    int g = h / (Hq / Hkv);
    const float* q = qkv + (b * T + i) * F + (long long)h * D;
    float acc[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) acc[u] = 0.0f;
    float m = -INFINITY, total = 0.0f;
    for (int j = 0; j < T; ++j) {
        if (!visible(i, j, causal, window, seg, b, T)) continue;
        const float* k = qkv + (b * T + j) * F + (long long)(Hq + g) * D;
        const float* v = qkv + (b * T + j) * F + (long long)(Hq + Hkv + g) * D;
        float s = logit(row_dot(q, k, D) * scale, softcap, slope, i, j, &th);
        float m_new = fmaxf(m, s);
        float alpha = expf(m - m_new), p = expf(s - m_new);
        total = total * alpha + p;
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
            int d = threadIdx.x + 32 * u;
            if (d < D) acc[u] = acc[u] * alpha + p * v[d];
        }
        m = m_new;
    }
    float* o = out + (b * T + i) * Hq * D + (long long)h * D;
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) o[d] = total > 0.0f ? acc[u] / total : 0.0f;
    }
    if (threadIdx.x == 0) lse[(b * Hq + h) * T + i] = total > 0.0f ? m + logf(total) : INFINITY;
}

// flash_attention_backward, queries: with P = exp(scale q_i . k_j - lse_i), dP = dO_i . v_j and
// shift_i = d_lse_i - dO_i . O_i: dq_i = scale sum_j P (dP + shift_i) k_j. Writes shift_i to
// shift[b, h, i] for the key kernel. d_out and d_lse may be null. Grid (T, Hq, B), 32 threads.
extern "C" __global__ void flash_attention_backward_dq_f32(const float* d_out, const float* qkv, const float* out,
                                                           const float* lse, const float* d_lse, const int* seg,
                                                           float* d_qkv, float* shift, int T, int Hq, int Hkv,
                                                           int D, int causal, int window, float scale,
                                                           float softcap, int alibi) {
    int i = blockIdx.x, h = blockIdx.y;
    float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D, row = (b * Hq + h) * T + i;
    int g = h / (Hq / Hkv);
    const float* q = qkv + (b * T + i) * F + (long long)h * D;
    const float* dO = d_out ? d_out + (b * T + i) * Hq * D + (long long)h * D : nullptr;
    float sh = d_lse ? d_lse[row] : 0.0f;
    if (dO) sh -= row_dot(dO, out + (b * T + i) * Hq * D + (long long)h * D, D);
    if (threadIdx.x == 0) shift[row] = sh;
    float l = lse[row], acc[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) acc[u] = 0.0f;
    for (int j = 0; j < T; ++j) {
        if (!visible(i, j, causal, window, seg, b, T)) continue;
        const float* k = qkv + (b * T + j) * F + (long long)(Hq + g) * D;
        float p = expf(logit(row_dot(q, k, D) * scale, softcap, slope, i, j, &th) - l);
        float dp = dO ? row_dot(dO, qkv + (b * T + j) * F + (long long)(Hq + Hkv + g) * D, D) : 0.0f;
        float ds = p * (dp + sh) * (1.0f - th * th);
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
            int d = threadIdx.x + 32 * u;
            if (d < D) acc[u] += ds * k[d];
        }
    }
    float* dq = d_qkv + (b * T + i) * F + (long long)h * D;
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) dq[d] = acc[u] * scale;
    }
}

// flash_attention_backward, keys: dk_j = sum over the group's query heads h and queries i that see j of
// P (dP + shift_i) scale q_i; dv_j = sum of P dO_i. Runs after the query kernel (reads its shift).
// Grid (T, Hkv, B), 32 threads.
extern "C" __global__ void flash_attention_backward_dkv_f32(const float* d_out, const float* qkv, const float* lse,
                                                            const float* shift, const int* seg, float* d_qkv,
                                                            int T, int Hq, int Hkv, int D, int causal,
                                                            int window, float scale, float softcap, int alibi) {
    int j = blockIdx.x, g = blockIdx.y, rep = Hq / Hkv;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    const float* k = qkv + (b * T + j) * F + (long long)(Hq + g) * D;
    const float* v = qkv + (b * T + j) * F + (long long)(Hq + Hkv + g) * D;
    float dk[PER_LANE], dv[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) dk[u] = dv[u] = 0.0f;
    for (int h = g * rep; h < (g + 1) * rep; ++h) {
        float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
        for (int i = 0; i < T; ++i) {
            if (!visible(i, j, causal, window, seg, b, T)) continue;
            long long row = (b * Hq + h) * T + i;
            const float* q = qkv + (b * T + i) * F + (long long)h * D;
            const float* dO = d_out ? d_out + (b * T + i) * Hq * D + (long long)h * D : nullptr;
            float p = expf(logit(row_dot(q, k, D) * scale, softcap, slope, i, j, &th) - lse[row]);
            float dp = dO ? row_dot(dO, v, D) : 0.0f;
            float ds = p * (dp + shift[row]) * (1.0f - th * th) * scale;
#pragma unroll
            for (int u = 0; u < PER_LANE; ++u) {
                int d = threadIdx.x + 32 * u;
                if (d < D) {
                    dk[u] += ds * q[d];
                    if (dO) dv[u] += p * dO[d];
                }
            }
        }
    }
    float* dkp = d_qkv + (b * T + j) * F + (long long)(Hq + g) * D;
    float* dvp = d_qkv + (b * T + j) * F + (long long)(Hq + Hkv + g) * D;
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) {
            dkp[d] = dk[u];
            dvp[d] = dv[u];
        }
    }
}

// qkv_qk_norm_rope: each q and k head of packed qkv becomes rope(x * rstd * weight) with
// rstd = 1 / sqrt(mean(x^2) + eps) over the head (rstd = 1 and no norm where the weight is null); v heads
// are copied. Pairs (d, d + half) rotate, half = rotary_dim / 2 ((2d, 2d + 1) when interleaved); dims past
// rotary_dim keep x * rstd * w.
// Grid (Hq + 2 Hkv, T, B), 32 threads; out is not qkv's storage (lanes read their partner's dim).
extern "C" __global__ void qkv_norm_rope_f32(const float* qkv, const float* q_weight, const float* k_weight,
                                             const float* freqs, const int* position_ids, float* out,
                                             float* q_rstd, float* k_rstd, int T, int Hq, int Hkv, int D,
                                             int rotary_dim, int pos_batched, float eps, float theta,
                                             int interleaved) {
    int hd = blockIdx.x, t = blockIdx.y, half = rotary_dim / 2;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    const float* x = qkv + (b * T + t) * F + (long long)hd * D;
    float* o = out + (b * T + t) * F + (long long)hd * D;
    if (hd >= Hq + Hkv) {
        for (int d = threadIdx.x; d < D; d += 32) o[d] = x[d];
        return;
    }
    const float* w = hd < Hq ? q_weight : k_weight;
    float r = 1.0f;
    if (w) r = 1.0f / sqrtf(row_dot(x, x, D) / D + eps);
    int pos = position_ids[pos_batched ? b * T + t : t];
    for (int d = threadIdx.x; d < D; d += 32) {
        float y;
        if (d < 2 * half) {
            int k;
            bool first;
            int p = rope_partner(d, half, interleaved, &k, &first);
            float c, s;
            rope_cos_sin(freqs, pos, k, half, rotary_dim, theta, &c, &s);
            y = x[d] * c * (w ? w[d] : 1.0f) + x[p] * (first ? -s : s) * (w ? w[p] : 1.0f);
        } else {
            y = x[d] * (w ? w[d] : 1.0f);
        }
        o[d] = r * y;
    }
    if (threadIdx.x == 0) {
        if (hd < Hq) q_rstd[(b * T + t) * Hq + hd] = r;
        else k_rstd[(b * T + t) * Hkv + hd - Hq] = r;
    }
}

// The gradient at dim d of a head before its rotation: the inverse rotation of dy.
__device__ __forceinline__ float unrotate(const float* dy, int d, int half, const float* freqs, int pos,
                                          int rotary_dim, float theta, int interleaved) {
    if (d >= 2 * half) return dy[d];
    int k;
    bool first;
    int p = rope_partner(d, half, interleaved, &k, &first);
    float c, s;
    rope_cos_sin(freqs, pos, k, half, rotary_dim, theta, &c, &s);
    return first ? dy[d] * c + dy[p] * s : dy[d] * c - dy[p] * s;
}

// qkv_qk_norm_rope_backward, d_qkv: g = the inverse rotation of d_out; with a norm weight w,
// d_x = rstd (g w - xhat mean(g w xhat)) - d_rstd rstd^3 x / D (xhat = x rstd), else d_x = g; v heads
// copy their gradient. d_out, the weights and d_*_rstd may be null. Grid (Hq + 2 Hkv, T, B), 32 threads.
extern "C" __global__ void qkv_norm_rope_backward_dx_f32(const float* d_out, const float* qkv,
                                                         const float* q_weight, const float* k_weight,
                                                         const float* freqs, const int* position_ids,
                                                         const float* q_rstd, const float* k_rstd,
                                                         const float* d_q_rstd, const float* d_k_rstd,
                                                         float* d_qkv, int T, int Hq, int Hkv, int D,
                                                         int rotary_dim, int pos_batched, float theta,
                                                         int interleaved) {
    int hd = blockIdx.x, t = blockIdx.y, half = rotary_dim / 2;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    const float* x = qkv + (b * T + t) * F + (long long)hd * D;
    const float* dy = d_out ? d_out + (b * T + t) * F + (long long)hd * D : nullptr;
    float* dx = d_qkv + (b * T + t) * F + (long long)hd * D;
    if (hd >= Hq + Hkv) {
        for (int d = threadIdx.x; d < D; d += 32) dx[d] = dy ? dy[d] : 0.0f;
        return;
    }
    bool is_q = hd < Hq;
    const float* w = is_q ? q_weight : k_weight;
    long long stat = is_q ? (b * T + t) * Hq + hd : (b * T + t) * Hkv + hd - Hq;
    float r = (is_q ? q_rstd : k_rstd)[stat];
    const float* d_rstd = is_q ? d_q_rstd : d_k_rstd;
    int pos = position_ids[pos_batched ? b * T + t : t];
    float dot = 0.0f;
    if (w && dy) {
        for (int d = threadIdx.x; d < D; d += 32)
            dot += unrotate(dy, d, half, freqs, pos, rotary_dim, theta, interleaved) * w[d] * (x[d] * r);
        dot = warp_sum(dot) / D;
    }
    float dr = (w && d_rstd) ? d_rstd[stat] * r * r * r / D : 0.0f;
    for (int d = threadIdx.x; d < D; d += 32) {
        float g = dy ? unrotate(dy, d, half, freqs, pos, rotary_dim, theta, interleaved) : 0.0f;
        dx[d] = w ? r * (g * w[d] - (x[d] * r) * dot) - dr * x[d] : g;
    }
}

// qkv_qk_norm_rope_backward, the norm weights: d_weight[d] = sum over rows (b, t, head) of g_d x_d rstd,
// q heads for d_q_weight (blockIdx.y = 0), k heads for d_k_weight (1); one thread per dim, rows in order.
// Grid (cdiv(D, 32), 2), 32 threads; a null weight's gradient is not written.
extern "C" __global__ void qkv_norm_rope_backward_dw_f32(const float* d_out, const float* qkv,
                                                         const float* q_weight, const float* k_weight,
                                                         const float* freqs, const int* position_ids,
                                                         const float* q_rstd, const float* k_rstd,
                                                         float* d_q_weight, float* d_k_weight, int B, int T,
                                                         int Hq, int Hkv, int D, int rotary_dim, int pos_batched,
                                                         float theta, int interleaved) {
    int d = blockIdx.x * 32 + threadIdx.x, half = rotary_dim / 2;
    bool is_q = blockIdx.y == 0;
    float* dw = is_q ? d_q_weight : d_k_weight;
    if (d >= D || !dw) return;
    if (!(is_q ? q_weight : k_weight)) {  // no norm: its weight (if any output asks) has no gradient
        dw[d] = 0.0f;
        return;
    }
    int heads = is_q ? Hq : Hkv, first = is_q ? 0 : Hq;
    const float* rstd = is_q ? q_rstd : k_rstd;
    long long F = (long long)(Hq + 2 * Hkv) * D;
    float acc = 0.0f;
    for (long long bt = 0; bt < (long long)B * T && d_out; ++bt) {
        int pos = position_ids[pos_batched ? bt : bt % T];
        for (int h = 0; h < heads; ++h) {
            long long base = bt * F + (long long)(first + h) * D;
            float g = unrotate(d_out + base, d, half, freqs, pos, rotary_dim, theta, interleaved);
            acc += g * (qkv[base + d] * rstd[bt * heads + h]);
        }
    }
    dw[d] = acc;
}

// qkv_qk_norm_rope under the bf16 recipe, its norm (NumPy's qkv_qk_norm_rope_bf16): each q and k head with a
// weight becomes bf16(x rstd) w (HF's RMSNorm: hidden_states.to(input_dtype) before the fp32 weight), rstd
// stored; other heads are copied (rstd 1). Rope then runs on the result (qkv_norm_rope_f32, no weights).
// Grid (Hq + 2 Hkv, T, B), 32 threads.
extern "C" __global__ void qk_norm_rp_bf16(const float* qkv, const float* q_weight, const float* k_weight,
                                           float* normed, float* q_rstd, float* k_rstd, int T, int Hq, int Hkv,
                                           int D, float eps) {
    int hd = blockIdx.x, t = blockIdx.y;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D;
    const float* x = qkv + (b * T + t) * F + (long long)hd * D;
    float* o = normed + (b * T + t) * F + (long long)hd * D;
    const float* w = hd < Hq ? q_weight : hd < Hq + Hkv ? k_weight : nullptr;
    float r = w ? 1.0f / sqrtf(row_dot(x, x, D) / D + eps) : 1.0f;
    for (int d = threadIdx.x; d < D; d += 32) o[d] = w ? round_bf16(x[d] * r) * w[d] : x[d];
    if (threadIdx.x == 0 && hd < Hq) q_rstd[(b * T + t) * Hq + hd] = r;
    if (threadIdx.x == 0 && hd >= Hq && hd < Hq + Hkv) k_rstd[(b * T + t) * Hkv + hd - Hq] = r;
}

// Its backward through the norm (qkv_qk_norm_rope_backward_bf16), after rope's transpose: g is the
// unrotated gradient [B, T, F]. A q or k head with a weight: d_u = bf16(g w), u = x rstd,
// d_x = rstd (d_u - u mean(d_u u)) - d_rstd rstd^3 x / D; other heads pass g; every d_x rounded to bf16
// (the projections are bf16). d_qkv may be g's storage: each lane writes only the dims it read.
// Grid (Hq + 2 Hkv, T, B), 32 threads.
extern "C" __global__ void qk_norm_backward_rp_bf16(const float* g_all, const float* qkv, const float* q_weight,
                                                    const float* k_weight, const float* q_rstd,
                                                    const float* k_rstd, const float* d_q_rstd,
                                                    const float* d_k_rstd, float* d_qkv, int T, int Hq, int Hkv,
                                                    int D) {
    int hd = blockIdx.x, t = blockIdx.y;
    long long b = blockIdx.z, F = (long long)(Hq + 2 * Hkv) * D, at = (b * T + t) * F + (long long)hd * D;
    bool is_q = hd < Hq, is_k = !is_q && hd < Hq + Hkv;
    const float* w = is_q ? q_weight : is_k ? k_weight : nullptr;
    const float *x = qkv + at, *g = g_all + at;
    float* dx = d_qkv + at;
    if (!w) {
        for (int d = threadIdx.x; d < D; d += 32) dx[d] = round_bf16(g[d]);
        return;
    }
    long long stat = is_q ? (b * T + t) * Hq + hd : (b * T + t) * Hkv + hd - Hq;
    float r = (is_q ? q_rstd : k_rstd)[stat];
    const float* d_rstd = is_q ? d_q_rstd : d_k_rstd;
    float du[PER_LANE], dot = 0.0f;
    for (int u = 0, d = threadIdx.x; d < D; ++u, d += 32) {
        du[u] = round_bf16(g[d] * w[d]);
        dot += du[u] * (x[d] * r);
    }
    dot = warp_sum(dot) / D;
    float dr = d_rstd ? d_rstd[stat] * r * r * r / D : 0.0f;
    for (int u = 0, d = threadIdx.x; d < D; ++u, d += 32)
        dx[d] = round_bf16(r * (du[u] - (x[d] * r) * dot) - dr * x[d]);
}

// The norm weights' gradients under the bf16 recipe: d_w[d] = sum over rows of g_d bf16(x_d rstd), g the
// unrotated gradient; q heads (blockIdx.y = 0) and k heads (1), rows in order. Grid (cdiv(D, 32), 2).
extern "C" __global__ void qk_norm_backward_dw_rp_bf16(const float* g_all, const float* qkv, const float* q_rstd,
                                                       const float* k_rstd, float* d_q_weight, float* d_k_weight,
                                                       int B, int T, int Hq, int Hkv, int D) {
    int d = blockIdx.x * 32 + threadIdx.x;
    bool is_q = blockIdx.y == 0;
    float* dw = is_q ? d_q_weight : d_k_weight;
    if (d >= D || !dw) return;
    int heads = is_q ? Hq : Hkv, first = is_q ? 0 : Hq;
    const float* rstd = is_q ? q_rstd : k_rstd;
    long long F = (long long)(Hq + 2 * Hkv) * D;
    float acc = 0.0f;
    for (long long bt = 0; bt < (long long)B * T; ++bt)
        for (int h = 0; h < heads; ++h) {
            long long at = bt * F + (long long)(first + h) * D + d;
            acc += g_all[at] * round_bf16(qkv[at] * rstd[bt * heads + h]);
        }
    dw[d] = acc;
}

// attention and attention_backward on separate q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D] (cross attention
// when Tq != Tk): the flash kernels' math with query i at key position p = i + Tk - Tq (aligned to the end
// of the keys, as the reference and flash-attn; p = i when Tq == Tk). Masks and ALiBi take p for i; segment
// ids are [B, Tk] and a query's segment is that of its key position (the launch requires Tq <= Tk then).
// out is [B, Tq, Hq, D], lse and shift [B, Hq, Tq]. Grid (Tq, Hq, B), 32 threads.
extern "C" __global__ void attention_f32(const float* q, const float* k, const float* v, const int* seg,
                                         float* out, float* lse, int Tq, int Tk, int Hq, int Hkv, int D,
                                         int causal, int window, float scale, float softcap, int alibi) {
    int i = blockIdx.x, h = blockIdx.y, p = i + Tk - Tq;
    float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
    long long b = blockIdx.z, row = (b * Tq + i) * Hq + h;
    int g = h / (Hq / Hkv);
    const float* qi = q + row * D;
    float acc[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) acc[u] = 0.0f;
    float m = -INFINITY, total = 0.0f;
    for (int j = 0; j < Tk; ++j) {
        if (!visible(p, j, causal, window, seg, b, Tk)) continue;
        long long kv = ((b * Tk + j) * Hkv + g) * D;
        float s = logit(row_dot(qi, k + kv, D) * scale, softcap, slope, p, j, &th);
        float m_new = fmaxf(m, s);
        float alpha = expf(m - m_new), e = expf(s - m_new);
        total = total * alpha + e;
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
            int d = threadIdx.x + 32 * u;
            if (d < D) acc[u] = acc[u] * alpha + e * v[kv + d];
        }
        m = m_new;
    }
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) out[row * D + d] = total > 0.0f ? acc[u] / total : 0.0f;
    }
    if (threadIdx.x == 0) lse[(b * Hq + h) * Tq + i] = total > 0.0f ? m + logf(total) : INFINITY;
}

// attention_backward, queries: dq_i = scale sum_j P (dP + shift_i) k_j with shift_i = d_lse_i - dO_i . O_i
// (written to shift for the key kernel); d_out and d_lse may be null. Grid (Tq, Hq, B), 32 threads.
extern "C" __global__ void attention_backward_dq_f32(const float* d_out, const float* q, const float* k,
                                                     const float* v, const float* out, const float* lse,
                                                     const float* d_lse, const int* seg, float* dq, float* shift,
                                                     int Tq, int Tk, int Hq, int Hkv, int D, int causal,
                                                     int window, float scale, float softcap, int alibi) {
    int i = blockIdx.x, h = blockIdx.y, p = i + Tk - Tq;
    float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
    long long b = blockIdx.z, row = (b * Tq + i) * Hq + h, stat = (b * Hq + h) * Tq + i;
    int g = h / (Hq / Hkv);
    const float* qi = q + row * D;
    const float* dO = d_out ? d_out + row * D : nullptr;
    float sh = d_lse ? d_lse[stat] : 0.0f;
    if (dO) sh -= row_dot(dO, out + row * D, D);
    if (threadIdx.x == 0) shift[stat] = sh;
    float l = lse[stat], acc[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) acc[u] = 0.0f;
    for (int j = 0; j < Tk; ++j) {
        if (!visible(p, j, causal, window, seg, b, Tk)) continue;
        long long kv = ((b * Tk + j) * Hkv + g) * D;
        float e = expf(logit(row_dot(qi, k + kv, D) * scale, softcap, slope, p, j, &th) - l);
        float dp = dO ? row_dot(dO, v + kv, D) : 0.0f;
        float ds = e * (dp + sh) * (1.0f - th * th);
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
            int d = threadIdx.x + 32 * u;
            if (d < D) acc[u] += ds * k[kv + d];
        }
    }
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) dq[row * D + d] = acc[u] * scale;
    }
}

// attention_backward, keys: dk_j = sum over the group's query heads and the queries that see key j (in
// order) of P (dP + shift_i) scale q_i; dv_j = sum of P dO_i. Runs after the query kernel (reads its shift).
// Grid (Tk, Hkv, B), 32 threads.
extern "C" __global__ void attention_backward_dkv_f32(const float* d_out, const float* q, const float* k,
                                                      const float* v, const float* lse, const float* shift,
                                                      const int* seg, float* dk, float* dv, int Tq, int Tk,
                                                      int Hq, int Hkv, int D, int causal, int window,
                                                      float scale, float softcap, int alibi) {
    int j = blockIdx.x, g = blockIdx.y, rep = Hq / Hkv;
    long long b = blockIdx.z, kv = ((b * Tk + j) * Hkv + g) * D;
    float gk[PER_LANE], gv[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) gk[u] = gv[u] = 0.0f;
    for (int h = g * rep; h < (g + 1) * rep; ++h) {
        float slope = alibi ? alibi_slope(h, Hq) : 0.0f, th;
        for (int i = 0; i < Tq; ++i) {
            int p = i + Tk - Tq;
            if (!visible(p, j, causal, window, seg, b, Tk)) continue;
            long long row = (b * Tq + i) * Hq + h, stat = (b * Hq + h) * Tq + i;
            const float* qi = q + row * D;
            const float* dO = d_out ? d_out + row * D : nullptr;
            float e = expf(logit(row_dot(qi, k + kv, D) * scale, softcap, slope, p, j, &th) - lse[stat]);
            float dp = dO ? row_dot(dO, v + kv, D) : 0.0f;
            float ds = e * (dp + shift[stat]) * (1.0f - th * th) * scale;
#pragma unroll
            for (int u = 0; u < PER_LANE; ++u) {
                int d = threadIdx.x + 32 * u;
                if (d < D) {
                    gk[u] += ds * qi[d];
                    if (dO) gv[u] += e * dO[d];
                }
            }
        }
    }
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        int d = threadIdx.x + 32 * u;
        if (d < D) {
            dk[kv + d] = gk[u];
            dv[kv + d] = gv[u];
        }
    }
}
