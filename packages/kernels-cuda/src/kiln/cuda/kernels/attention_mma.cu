// Flash attention on packed bf16 qkv [B, T, (Hq + 2 Hkv) * D] on tensor cores (sm_80+: mma.sync m16n8k16,
// bf16 in, fp32 accumulate), FlashAttention-2's tiling, and its SIMT twin: the same code with the one
// product instruction replaced by shuffles and fp32 math (mma16816<false>, bf16.cuh), which the CPU
// emulator runs. kiln.core ops/library/_attention.py flash_attention and flash_attention_backward are the
// reference, with attention's softcap (c tanh(s / c); 0 = none) and ALiBi (-slope_h |i - j|) on the
// scores, in that order, before the masks: causal, a sliding window, segment ids. out and d_qkv are bf16
// (rounded to nearest even); lse and the backward's row shifts are fp32.
//
// A block is 4 warps; each warp owns 16 rows of the tile (queries, or keys in the dk/dv kernel) and
// holds its accumulators in the mma C fragments. A score fragment turns into the A fragment of the next
// product in registers (its C layout is A's, two 8-column tiles making one 16-wide k step). Head dims
// are padded with zeros to HD (64 or 128: one kernel each). Every sum runs in a fixed order.
#include "bf16.cuh"

constexpr int WARPS = 4, PAD = 8;  // PAD: shared rows of HD + 8 bf16, off the bank of the next row
constexpr int FWD_ROWS = 64, FWD_KEYS = 32, DQ_ROWS = 64, DQ_KEYS = 16, DKV_KEYS = 64, DKV_ROWS = 16;

struct Attn {
    int T, Hq, Hkv, D, causal, window;
    float scale, softcap;
    int alibi;
    const int* seg;
    long long b;

    __device__ bool sees(int i, int j) const {
        if (i >= T || j >= T || (causal && j > i)) return false;
        if (window > 0 && (j <= i - window || (!causal && j >= i + window))) return false;
        return !seg || seg[b * T + i] == seg[b * T + j];
    }

    // The logit of raw score s = q . k of query i and key j (-inf where j is not seen); *th is
    // tanh(s scale / softcap), for the cap's derivative 1 - th^2.
    __device__ float logit(float s, float slope, int i, int j, float* th) const {
        *th = 0.0f;
        if (!sees(i, j)) return -INFINITY;
        s *= scale;
        if (softcap > 0.0f) {
            *th = tanhf(s / softcap);
            s = softcap * *th;
        }
        return s - slope * fabsf((float)(i - j));
    }

    // Keys any query of [i0, i1) may see, and queries that may see a key of [j0, j1) (before segments).
    __device__ int key_begin(int i0) const { return (window > 0) ? max(0, i0 - window + 1) : 0; }
    __device__ int key_end(int i1) const {
        return causal ? min(T, i1) : (window > 0 ? min(T, i1 - 1 + window) : T);
    }
    __device__ int query_begin(int j0) const {
        return causal ? j0 : (window > 0 ? max(0, j0 - window + 1) : 0);
    }
    __device__ int query_end(int j1) const { return window > 0 ? min(T, j1 - 1 + window) : T; }
};

// An element of qkv as bf16: a bf16 one as it is, a float32 one rounded to nearest even (the bf16 recipe's
// rounding of attention's input, with no rounded copy of qkv); a gradient stored into d_qkv's type: bf16,
// or float32 holding the bf16 value (as a bf16 result widened).
__device__ __forceinline__ bf16 as_bf16(bf16 x) { return x; }
__device__ __forceinline__ bf16 as_bf16(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ void put_bf16(bf16* p, long long i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void put_bf16(float* p, long long i, float v) { p[i] = round_bf16(v); }

// Rows [r0, r0 + n) of a [T, stride] bf16 (or float32, rounded) matrix (columns [0, D) of each row) into
// tile[n][HD + PAD]; zeros past T, past D, and everywhere when base is null.
template <int HD, typename QT>
__device__ void load_tile(bf16 (*tile)[HD + PAD], int n, const QT* base, long long stride, int r0, int T,
                          int D) {
    for (int e = threadIdx.x; e < n * HD; e += blockDim.x) {
        int r = e / HD, c = e % HD;
        tile[r][c] = (base && r0 + r < T && c < D) ? as_bf16(base[(r0 + r) * stride + c]) : (bf16)0;
    }
}

// The A fragment of rows [r0, r0 + 16) and columns [k0, k0 + 16) of a row-major tile.
template <int HD>
__device__ __forceinline__ void frag_a(unsigned* a, const bf16 (*t)[HD + PAD], int r0, int k0) {
    int g = threadIdx.x % 32 / 4, c = k0 + 2 * (threadIdx.x % 4);
    a[0] = pair_bf16(t[r0 + g][c], t[r0 + g][c + 1]);
    a[1] = pair_bf16(t[r0 + g + 8][c], t[r0 + g + 8][c + 1]);
    a[2] = pair_bf16(t[r0 + g][c + 8], t[r0 + g][c + 9]);
    a[3] = pair_bf16(t[r0 + g + 8][c + 8], t[r0 + g + 8][c + 9]);
}

// The B fragment (16 x 8) of B[k][n] = t[n0 + n][k0 + k]: a tile whose rows are B's columns (K for Q K^T).
template <int HD>
__device__ __forceinline__ void frag_bt(unsigned* b, const bf16 (*t)[HD + PAD], int n0, int k0) {
    int g = threadIdx.x % 32 / 4, c = k0 + 2 * (threadIdx.x % 4);
    b[0] = pair_bf16(t[n0 + g][c], t[n0 + g][c + 1]);
    b[1] = pair_bf16(t[n0 + g][c + 8], t[n0 + g][c + 9]);
}

// The B fragment of B[k][n] = t[k0 + k][n0 + n]: a tile whose rows are B's rows (V for P V).
template <int HD>
__device__ __forceinline__ void frag_b(unsigned* b, const bf16 (*t)[HD + PAD], int k0, int n0) {
    int g = threadIdx.x % 32 / 4, r = k0 + 2 * (threadIdx.x % 4);
    b[0] = pair_bf16(t[r][n0 + g], t[r + 1][n0 + g]);
    b[1] = pair_bf16(t[r + 8][n0 + g], t[r + 9][n0 + g]);
}

// Two C fragments (columns [0, 8) and [8, 16) of 16 rows) as one A fragment (16 x 16), rounded to bf16.
__device__ __forceinline__ void c_to_a(unsigned* a, const float* c0, const float* c1) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

// Columns [0, D) of a warp's 16 x HD accumulator (times f) into rows r0, r0 + 8 of its C layout.
template <int HD, typename GT>
__device__ void store_rows(const float (*acc)[4], float f, GT* base, long long stride, int r0, int T, int D) {
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = r0 + g + 8 * (e / 2), c = 8 * dn + 2 * t + (e & 1);
            if (r < T && c < D) put_bf16(base, r * stride + c, acc[dn][e] * f);
        }
}

// flash_attention: out = softmax(logits) v over the keys each query sees, lse = log-sum-exp of the logits
// (+inf, out = 0, for a row that sees none). Grid (cdiv(T, 64), Hq, B), 128 threads.
template <bool TC, int HD, typename QT>
__device__ void attn_forward(const QT* qkv, bf16* out, float* lse, Attn a) {
    __shared__ bf16 qs[FWD_ROWS][HD + PAD], ks[FWD_KEYS][HD + PAD], vs[FWD_KEYS][HD + PAD];
    int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    int q0 = blockIdx.x * FWD_ROWS, h = blockIdx.y, kvh = h / (a.Hq / a.Hkv), D = a.D;
    long long F = (long long)(a.Hq + 2 * a.Hkv) * D;
    const QT* seq = qkv + a.b * a.T * F;
    float slope = a.alibi ? alibi_slope(h, a.Hq) : 0.0f;
    load_tile<HD>(qs, FWD_ROWS, seq + (long long)h * D, F, q0, a.T, D);
    int rows[2] = {q0 + 16 * w + g, q0 + 16 * w + g + 8};
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    int k_end = a.key_end(q0 + FWD_ROWS);
    for (int k0 = a.key_begin(q0) / FWD_KEYS * FWD_KEYS; k0 < k_end; k0 += FWD_KEYS) {
        __syncthreads();  // every warp is done with the previous tiles (and the q tile is in)
        load_tile<HD>(ks, FWD_KEYS, seq + (long long)(a.Hq + kvh) * D, F, k0, a.T, D);
        load_tile<HD>(vs, FWD_KEYS, seq + (long long)(a.Hq + a.Hkv + kvh) * D, F, k0, a.T, D);
        __syncthreads();
        float s[FWD_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            if (16 * kk >= D) break;
            unsigned fa[4], fb[2];
            frag_a<HD>(fa, qs, 16 * w, 16 * kk);
#pragma unroll
            for (int nt = 0; nt < FWD_KEYS / 8; ++nt) {
                frag_bt<HD>(fb, ks, 8 * nt, 16 * kk);
                mma16816<TC>(s[nt], fa, fb);
            }
        }
        float mx[2] = {-INFINITY, -INFINITY}, th;
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = a.logit(s[nt][e], slope, rows[e / 2], k0 + 8 * nt + 2 * t + (e & 1), &th);
                mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // a row's 4 lanes: t = 0..3 of one g
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            float m_new = fmaxf(m[r], mx[r]);
            float alpha = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha;
#pragma unroll
            for (int dn = 0; dn < HD / 8; ++dn) {
                o[dn][2 * r] *= alpha;
                o[dn][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = s[nt][e] == -INFINITY ? 0.0f : expf(s[nt][e] - m[e / 2]);
                s[nt][e] = p;
                l[e / 2] += p;
            }
#pragma unroll
        for (int kk = 0; kk < FWD_KEYS / 16; ++kk) {
            unsigned fa[4], fb[2];
            c_to_a(fa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dn = 0; dn < HD / 8; ++dn) {
                if (8 * dn >= D) break;
                frag_b<HD>(fb, vs, 16 * kk, 8 * dn);
                mma16816<TC>(o[dn], fa, fb);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
    float (*acc)[4] = o;
    bf16* orow = out + a.b * a.T * a.Hq * D + (long long)h * D;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dn][e] *= l[e / 2] > 0.0f ? 1.0f / l[e / 2] : 0.0f;
    store_rows<HD>(acc, 1.0f, orow, (long long)a.Hq * D, q0 + 16 * w, a.T, D);
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (t == 0 && rows[r] < a.T)
            lse[(a.b * a.Hq + h) * a.T + rows[r]] = l[r] > 0.0f ? m[r] + logf(l[r]) : INFINITY;
}

// flash_attention_backward, queries: with P = exp(logit - lse), dP = dO v^T and shift = d_lse - rowsum(dO O),
// dS = P (dP + shift) (times 1 - th^2 under a softcap) and dq = scale dS k. Writes each row's shift for
// the key kernel. d_out and d_lse may be null. Grid (cdiv(T, 64), Hq, B), 128 threads.
template <bool TC, int HD, typename QT, typename GT>
__device__ void attn_backward_dq(const bf16* d_out, const QT* qkv, const bf16* out, const float* lse,
                                 const float* d_lse, GT* d_qkv, float* shift, Attn a) {
    __shared__ bf16 qs[DQ_ROWS][HD + PAD], dos[DQ_ROWS][HD + PAD], ks[DQ_KEYS][HD + PAD],
        vs[DQ_KEYS][HD + PAD];
    __shared__ float sh[DQ_ROWS], ls[DQ_ROWS];
    int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int q0 = blockIdx.x * DQ_ROWS, h = blockIdx.y, kvh = h / (a.Hq / a.Hkv), D = a.D;
    long long F = (long long)(a.Hq + 2 * a.Hkv) * D, O = (long long)a.Hq * D;
    const QT* seq = qkv + a.b * a.T * F;
    float slope = a.alibi ? alibi_slope(h, a.Hq) : 0.0f;
    load_tile<HD>(qs, DQ_ROWS, seq + (long long)h * D, F, q0, a.T, D);
    load_tile<HD>(dos, DQ_ROWS, d_out ? d_out + a.b * a.T * O + (long long)h * D : nullptr, O, q0, a.T, D);
    for (int r = w; r < DQ_ROWS; r += WARPS) {  // a warp per row: shift = d_lse - dO . O
        int i = q0 + r;
        long long row = (a.b * a.Hq + h) * a.T + i;
        float dot = 0.0f;
        if (d_out && i < a.T)
            for (int c = lane; c < D; c += 32)
                dot += bf16_to_f32(d_out[(a.b * a.T + i) * O + (long long)h * D + c]) *
                       bf16_to_f32(out[(a.b * a.T + i) * O + (long long)h * D + c]);
        dot = warp_sum(dot);
        if (lane == 0) {
            sh[r] = i < a.T ? (d_lse ? d_lse[row] : 0.0f) - dot : 0.0f;
            ls[r] = i < a.T ? lse[row] : INFINITY;
            if (i < a.T) shift[row] = sh[r];
        }
    }
    float dq[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.0f;
    int k_end = a.key_end(q0 + DQ_ROWS);
    for (int k0 = a.key_begin(q0) / DQ_KEYS * DQ_KEYS; k0 < k_end; k0 += DQ_KEYS) {
        __syncthreads();
        load_tile<HD>(ks, DQ_KEYS, seq + (long long)(a.Hq + kvh) * D, F, k0, a.T, D);
        load_tile<HD>(vs, DQ_KEYS, seq + (long long)(a.Hq + a.Hkv + kvh) * D, F, k0, a.T, D);
        __syncthreads();
        float s[DQ_KEYS / 8][4], dp[DQ_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < DQ_KEYS / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            if (16 * kk >= D) break;
            unsigned fq[4], fo[4], fb[2];
            frag_a<HD>(fq, qs, 16 * w, 16 * kk);
            frag_a<HD>(fo, dos, 16 * w, 16 * kk);
#pragma unroll
            for (int nt = 0; nt < DQ_KEYS / 8; ++nt) {
                frag_bt<HD>(fb, ks, 8 * nt, 16 * kk);
                mma16816<TC>(s[nt], fq, fb);
                frag_bt<HD>(fb, vs, 8 * nt, 16 * kk);
                mma16816<TC>(dp[nt], fo, fb);
            }
        }
#pragma unroll
        for (int nt = 0; nt < DQ_KEYS / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int lr = 16 * w + g + 8 * (e / 2);
                float th, x = a.logit(s[nt][e], slope, q0 + lr, k0 + 8 * nt + 2 * t + (e & 1), &th);
                float p = x == -INFINITY ? 0.0f : expf(x - ls[lr]);
                s[nt][e] = p * (dp[nt][e] + sh[lr]) * (a.softcap > 0.0f ? 1.0f - th * th : 1.0f);
            }
#pragma unroll
        for (int kk = 0; kk < DQ_KEYS / 16; ++kk) {
            unsigned fa[4], fb[2];
            c_to_a(fa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dn = 0; dn < HD / 8; ++dn) {
                if (8 * dn >= D) break;
                frag_b<HD>(fb, ks, 16 * kk, 8 * dn);
                mma16816<TC>(dq[dn], fa, fb);
            }
        }
    }
    store_rows<HD>(dq, a.scale, d_qkv + a.b * a.T * F + (long long)h * D, F, q0 + 16 * w, a.T, D);
}

// flash_attention_backward, keys: over the group's query heads and the queries that see them,
// dv = P^T dO and dk = scale dS^T q (P, dS as in the query kernel, whose shifts it reads; it runs after).
// A warp owns 16 keys. Grid (cdiv(T, 64), Hkv, B), 128 threads.
template <bool TC, int HD, typename QT, typename GT>
__device__ void attn_backward_dkv(const bf16* d_out, const QT* qkv, const float* lse, const float* shift,
                                  GT* d_qkv, Attn a) {
    __shared__ bf16 ks[DKV_KEYS][HD + PAD], vs[DKV_KEYS][HD + PAD], qs[DKV_ROWS][HD + PAD],
        dos[DKV_ROWS][HD + PAD];
    __shared__ float sh[DKV_ROWS], ls[DKV_ROWS];
    int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    int j0 = blockIdx.x * DKV_KEYS, kvh = blockIdx.y, rep = a.Hq / a.Hkv, D = a.D;
    long long F = (long long)(a.Hq + 2 * a.Hkv) * D, O = (long long)a.Hq * D;
    const QT* seq = qkv + a.b * a.T * F;
    load_tile<HD>(ks, DKV_KEYS, seq + (long long)(a.Hq + kvh) * D, F, j0, a.T, D);
    load_tile<HD>(vs, DKV_KEYS, seq + (long long)(a.Hq + a.Hkv + kvh) * D, F, j0, a.T, D);
    int keys[2] = {j0 + 16 * w + g, j0 + 16 * w + g + 8};
    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[dn][e] = dv[dn][e] = 0.0f;
    int i_end = a.query_end(j0 + DKV_KEYS);
    for (int h = kvh * rep; h < (kvh + 1) * rep; ++h) {
        float slope = a.alibi ? alibi_slope(h, a.Hq) : 0.0f;
        for (int i0 = a.query_begin(j0) / DKV_ROWS * DKV_ROWS; i0 < i_end; i0 += DKV_ROWS) {
            __syncthreads();
            load_tile<HD>(qs, DKV_ROWS, seq + (long long)h * D, F, i0, a.T, D);
            load_tile<HD>(dos, DKV_ROWS, d_out ? d_out + a.b * a.T * O + (long long)h * D : nullptr, O, i0,
                          a.T, D);
            if (threadIdx.x < DKV_ROWS) {
                int i = i0 + threadIdx.x;
                long long row = (a.b * a.Hq + h) * a.T + i;
                ls[threadIdx.x] = i < a.T ? lse[row] : INFINITY;
                sh[threadIdx.x] = i < a.T ? shift[row] : 0.0f;
            }
            __syncthreads();
            float s[DKV_ROWS / 8][4], dp[DKV_ROWS / 8][4];  // transposed: rows are keys, columns queries
#pragma unroll
            for (int nt = 0; nt < DKV_ROWS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                if (16 * kk >= D) break;
                unsigned fk[4], fv[4], fb[2];
                frag_a<HD>(fk, ks, 16 * w, 16 * kk);
                frag_a<HD>(fv, vs, 16 * w, 16 * kk);
#pragma unroll
                for (int nt = 0; nt < DKV_ROWS / 8; ++nt) {
                    frag_bt<HD>(fb, qs, 8 * nt, 16 * kk);
                    mma16816<TC>(s[nt], fk, fb);
                    frag_bt<HD>(fb, dos, 8 * nt, 16 * kk);
                    mma16816<TC>(dp[nt], fv, fb);
                }
            }
#pragma unroll
            for (int nt = 0; nt < DKV_ROWS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int lr = 8 * nt + 2 * t + (e & 1);
                    float th, x = a.logit(s[nt][e], slope, i0 + lr, keys[e / 2], &th);
                    float p = x == -INFINITY ? 0.0f : expf(x - ls[lr]);
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] + sh[lr]) * (a.softcap > 0.0f ? 1.0f - th * th : 1.0f);
                }
#pragma unroll
            for (int kk = 0; kk < DKV_ROWS / 16; ++kk) {
                unsigned fp[4], fs[4], fb[2];
                c_to_a(fp, s[2 * kk], s[2 * kk + 1]);
                c_to_a(fs, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
                for (int dn = 0; dn < HD / 8; ++dn) {
                    if (8 * dn >= D) break;
                    frag_b<HD>(fb, dos, 16 * kk, 8 * dn);
                    mma16816<TC>(dv[dn], fp, fb);
                    frag_b<HD>(fb, qs, 16 * kk, 8 * dn);
                    mma16816<TC>(dk[dn], fs, fb);
                }
            }
        }
    }
    store_rows<HD>(dk, a.scale, d_qkv + a.b * a.T * F + (long long)(a.Hq + kvh) * D, F, j0 + 16 * w, a.T, D);
    store_rows<HD>(dv, 1.0f, d_qkv + a.b * a.T * F + (long long)(a.Hq + a.Hkv + kvh) * D, F, j0 + 16 * w, a.T,
                   D);
}

// The kernels: <variant><HD>, tc (tensor cores, sm_80+) and twin (SIMT), HD = 64 or 128.

__device__ __forceinline__ Attn attn(int T, int Hq, int Hkv, int D, int causal, int window, float scale,
                                     float softcap, int alibi, const int* seg) {
    return Attn{T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg, (long long)blockIdx.z};
}

extern "C" __global__ void flash_attention_twin64_bf16(const bf16* qkv, const int* seg, bf16* out, float* lse,
                                                       int T, int Hq, int Hkv, int D, int causal, int window,
                                                       float scale, float softcap, int alibi) {
    attn_forward<false, 64>(qkv, out, lse, attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_twin128_bf16(const bf16* qkv, const int* seg, bf16* out, float* lse,
                                                        int T, int Hq, int Hkv, int D, int causal, int window,
                                                        float scale, float softcap, int alibi) {
    attn_forward<false, 128>(qkv, out, lse, attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dq_twin64_bf16(
    const bf16* d_out, const bf16* qkv, const bf16* out, const float* lse, const float* d_lse, const int* seg,
    bf16* d_qkv, float* shift, int T, int Hq, int Hkv, int D, int causal, int window, float scale, float softcap,
    int alibi) {
    attn_backward_dq<false, 64>(d_out, qkv, out, lse, d_lse, d_qkv, shift,
                                attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dq_twin128_bf16(
    const bf16* d_out, const bf16* qkv, const bf16* out, const float* lse, const float* d_lse, const int* seg,
    bf16* d_qkv, float* shift, int T, int Hq, int Hkv, int D, int causal, int window, float scale, float softcap,
    int alibi) {
    attn_backward_dq<false, 128>(d_out, qkv, out, lse, d_lse, d_qkv, shift,
                                 attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dkv_twin64_bf16(
    const bf16* d_out, const bf16* qkv, const float* lse, const float* shift, const int* seg, bf16* d_qkv, int T,
    int Hq, int Hkv, int D, int causal, int window, float scale, float softcap, int alibi) {
    attn_backward_dkv<false, 64>(d_out, qkv, lse, shift, d_qkv,
                                 attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dkv_twin128_bf16(
    const bf16* d_out, const bf16* qkv, const float* lse, const float* shift, const int* seg, bf16* d_qkv, int T,
    int Hq, int Hkv, int D, int causal, int window, float scale, float softcap, int alibi) {
    attn_backward_dkv<false, 128>(d_out, qkv, lse, shift, d_qkv,
                                  attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

#ifndef KILN_EMULATOR  // mma.sync needs a GPU: compiled and layout-checked here, run by `nox -s gpu`

extern "C" __global__ void flash_attention_tc64_bf16(const bf16* qkv, const int* seg, bf16* out, float* lse,
                                                     int T, int Hq, int Hkv, int D, int causal, int window,
                                                     float scale, float softcap, int alibi) {
    attn_forward<true, 64>(qkv, out, lse, attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_tc128_bf16(const bf16* qkv, const int* seg, bf16* out, float* lse,
                                                      int T, int Hq, int Hkv, int D, int causal, int window,
                                                      float scale, float softcap, int alibi) {
    attn_forward<true, 128>(qkv, out, lse, attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dq_tc64_bf16(
    const bf16* d_out, const bf16* qkv, const bf16* out, const float* lse, const float* d_lse, const int* seg,
    bf16* d_qkv, float* shift, int T, int Hq, int Hkv, int D, int causal, int window, float scale, float softcap,
    int alibi) {
    attn_backward_dq<true, 64>(d_out, qkv, out, lse, d_lse, d_qkv, shift,
                               attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dq_tc128_bf16(
    const bf16* d_out, const bf16* qkv, const bf16* out, const float* lse, const float* d_lse, const int* seg,
    bf16* d_qkv, float* shift, int T, int Hq, int Hkv, int D, int causal, int window, float scale, float softcap,
    int alibi) {
    attn_backward_dq<true, 128>(d_out, qkv, out, lse, d_lse, d_qkv, shift,
                                attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dkv_tc64_bf16(
    const bf16* d_out, const bf16* qkv, const float* lse, const float* shift, const int* seg, bf16* d_qkv, int T,
    int Hq, int Hkv, int D, int causal, int window, float scale, float softcap, int alibi) {
    attn_backward_dkv<true, 64>(d_out, qkv, lse, shift, d_qkv,
                                attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

extern "C" __global__ void flash_attention_backward_dkv_tc128_bf16(
    const bf16* d_out, const bf16* qkv, const float* lse, const float* shift, const int* seg, bf16* d_qkv, int T,
    int Hq, int Hkv, int D, int causal, int window, float scale, float softcap, int alibi) {
    attn_backward_dkv<true, 128>(d_out, qkv, lse, shift, d_qkv,
                                 attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));
}

#endif

// The bf16 recipe's variants on the slots as a Program holds them: _bf16_f reads a float32 qkv (rounded on
// load); the backward's _bf16_<qkv><d_qkv> (h: bf16, f: float32) write d_qkv as float32 (bf16 values).
#define FWD_PARAMS(QT)                                                                                          \
    const QT *qkv, const int *seg, bf16 *out, float *lse, int T, int Hq, int Hkv, int D, int causal, int window, \
        float scale, float softcap, int alibi
#define FWD_BODY(TC, HD)                                                                                        \
    { attn_forward<TC, HD>(qkv, out, lse, attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg)); }
#define DQ_PARAMS(QT, GT)                                                                                       \
    const bf16 *d_out, const QT *qkv, const bf16 *out, const float *lse, const float *d_lse, const int *seg,    \
        GT *d_qkv, float *shift, int T, int Hq, int Hkv, int D, int causal, int window, float scale,            \
        float softcap, int alibi
#define DQ_BODY(TC, HD)                                                                                         \
    {                                                                                                           \
        attn_backward_dq<TC, HD>(d_out, qkv, out, lse, d_lse, d_qkv, shift,                                     \
                                 attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));              \
    }
#define DKV_PARAMS(QT, GT)                                                                                      \
    const bf16 *d_out, const QT *qkv, const float *lse, const float *shift, const int *seg, GT *d_qkv, int T,   \
        int Hq, int Hkv, int D, int causal, int window, float scale, float softcap, int alibi
#define DKV_BODY(TC, HD)                                                                                        \
    {                                                                                                           \
        attn_backward_dkv<TC, HD>(d_out, qkv, lse, shift, d_qkv,                                                \
                                  attn(T, Hq, Hkv, D, causal, window, scale, softcap, alibi, seg));             \
    }

extern "C" __global__ void flash_attention_twin64_bf16_f(FWD_PARAMS(float)) FWD_BODY(false, 64)
extern "C" __global__ void flash_attention_backward_dq_twin64_bf16_hf(DQ_PARAMS(bf16, float))
    DQ_BODY(false, 64)
extern "C" __global__ void flash_attention_backward_dkv_twin64_bf16_hf(DKV_PARAMS(bf16, float))
    DKV_BODY(false, 64)
extern "C" __global__ void flash_attention_backward_dq_twin64_bf16_ff(DQ_PARAMS(float, float))
    DQ_BODY(false, 64)
extern "C" __global__ void flash_attention_backward_dkv_twin64_bf16_ff(DKV_PARAMS(float, float))
    DKV_BODY(false, 64)
extern "C" __global__ void flash_attention_twin128_bf16_f(FWD_PARAMS(float)) FWD_BODY(false, 128)
extern "C" __global__ void flash_attention_backward_dq_twin128_bf16_hf(DQ_PARAMS(bf16, float))
    DQ_BODY(false, 128)
extern "C" __global__ void flash_attention_backward_dkv_twin128_bf16_hf(DKV_PARAMS(bf16, float))
    DKV_BODY(false, 128)
extern "C" __global__ void flash_attention_backward_dq_twin128_bf16_ff(DQ_PARAMS(float, float))
    DQ_BODY(false, 128)
extern "C" __global__ void flash_attention_backward_dkv_twin128_bf16_ff(DKV_PARAMS(float, float))
    DKV_BODY(false, 128)
extern "C" __global__ void flash_attention_tc64_bf16_f(FWD_PARAMS(float)) FWD_BODY(true, 64)
extern "C" __global__ void flash_attention_backward_dq_tc64_bf16_hf(DQ_PARAMS(bf16, float))
    DQ_BODY(true, 64)
extern "C" __global__ void flash_attention_backward_dkv_tc64_bf16_hf(DKV_PARAMS(bf16, float))
    DKV_BODY(true, 64)
extern "C" __global__ void flash_attention_backward_dq_tc64_bf16_ff(DQ_PARAMS(float, float))
    DQ_BODY(true, 64)
extern "C" __global__ void flash_attention_backward_dkv_tc64_bf16_ff(DKV_PARAMS(float, float))
    DKV_BODY(true, 64)
extern "C" __global__ void flash_attention_tc128_bf16_f(FWD_PARAMS(float)) FWD_BODY(true, 128)
extern "C" __global__ void flash_attention_backward_dq_tc128_bf16_hf(DQ_PARAMS(bf16, float))
    DQ_BODY(true, 128)
extern "C" __global__ void flash_attention_backward_dkv_tc128_bf16_hf(DKV_PARAMS(bf16, float))
    DKV_BODY(true, 128)
extern "C" __global__ void flash_attention_backward_dq_tc128_bf16_ff(DQ_PARAMS(float, float))
    DQ_BODY(true, 128)
extern "C" __global__ void flash_attention_backward_dkv_tc128_bf16_ff(DKV_PARAMS(float, float))
    DKV_BODY(true, 128)
