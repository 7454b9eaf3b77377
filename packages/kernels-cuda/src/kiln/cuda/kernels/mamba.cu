// Mamba's causal depthwise conv1d (kiln.core ops/library/_mamba.py mamba_conv1d), channels-first x [B, D, T],
// weight [D, 1, K], bias [D] (may be null), conv_state [B, D, K - 1] (the K - 1 inputs before x; null: zeros).
// xp = [conv_state | x] along time: pre[t] = sum_j w[j] xp[t + j] (+ bias), y = silu(pre) or pre.
// One thread per (b, d, t), grid-stride. The backward recomputes pre from the inputs.
#include "common.cuh"

__device__ __forceinline__ float padded(const float* x, const float* state, long long bd, int s, int T, int K) {
    if (s >= K - 1) return x[bd * T + (s - (K - 1))];
    return state ? state[bd * (K - 1) + s] : 0.0f;
}

__device__ __forceinline__ float conv_pre(const float* x, const float* w, const float* bias, const float* state,
                                          long long bd, int d, int t, int T, int K) {
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) acc += w[d * K + j] * padded(x, state, bd, t + j, T, K);
    return bias ? acc + bias[d] : acc;
}

extern "C" __global__ void mamba_conv1d_f32(const float* x, const float* w, const float* bias, const float* state,
                                            float* y, long long BD, int D, int T, int K, int silu) {
    for (long long i = first_index(); i < BD * T; i += grid_stride()) {
        long long bd = i / T;
        float pre = conv_pre(x, w, bias, state, bd, (int)(bd % D), (int)(i % T), T, K);
        y[i] = silu ? pre * (0.5f * (1.0f + tanhf(0.5f * pre))) : pre;
    }
}

// return_final_states: the last K - 1 inputs of xp (reaching into conv_state when T < K - 1), the state of
// the next chunk. One thread per (b, d, i < K - 1).
extern "C" __global__ void mamba_conv1d_state_f32(const float* x, const float* state, float* state_out,
                                                  long long BD, int T, int K) {
    for (long long i = first_index(); i < BD * (K - 1); i += grid_stride())
        state_out[i] = padded(x, state, i / (K - 1), T + (int)(i % (K - 1)), T, K);
}

// The gradient at the pre-activation: g = d_y * silu'(pre) (or d_y). One thread per (b, d, t).
extern "C" __global__ void mamba_conv1d_grad_f32(const float* d_y, const float* x, const float* w,
                                                 const float* bias, const float* state, float* g, long long BD,
                                                 int D, int T, int K, int silu) {
    for (long long i = first_index(); i < BD * T; i += grid_stride()) {
        long long bd = i / T;
        float d = d_y[i];
        if (silu) {
            float pre = conv_pre(x, w, bias, state, bd, (int)(bd % D), (int)(i % T), T, K);
            float s = 0.5f * (1.0f + tanhf(0.5f * pre));
            d *= s * (1.0f + pre * (1.0f - s));
        }
        g[i] = d;
    }
}

// d_xp[s] = sum_j w[j] g[s - j] over 0 <= s - j < T, plus d_state_out[s - T] for s >= T (the final state's
// gradient, when not null): d_x[t] = d_xp[t + K - 1], d_state[s] = d_xp[s] (s < K - 1, when d_state is not
// null). One thread per (b, d, s), s < T + K - 1.
extern "C" __global__ void mamba_conv1d_backward_dx_f32(const float* g, const float* w, const float* d_state_out,
                                                        float* d_x, float* d_state, long long BD, int D, int T,
                                                        int K) {
    int S = T + K - 1;
    for (long long i = first_index(); i < BD * S; i += grid_stride()) {
        long long bd = i / S;
        int s = (int)(i % S), d = (int)(bd % D);
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            int t = s - j;
            if (t >= 0 && t < T) acc += w[d * K + j] * g[bd * T + t];
        }
        if (d_state_out && s >= T) acc += d_state_out[bd * (K - 1) + (s - T)];
        if (s >= K - 1) d_x[bd * T + (s - (K - 1))] = acc;
        else if (d_state) d_state[bd * (K - 1) + s] = acc;
    }
}

// d_weight[d, j] = sum over b, then t (in order) of g[b, d, t] xp[b, d, t + j]; j == K: d_bias[d] = sum of g.
// One thread per (d, j <= K).
extern "C" __global__ void mamba_conv1d_backward_dw_f32(const float* g, const float* x, const float* state,
                                                        float* d_w, float* d_bias, int B, int D, int T, int K) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= D * (K + 1)) return;
    int d = i / (K + 1), j = i % (K + 1);
    float acc = 0.0f;
    for (int b = 0; b < B; ++b) {
        long long bd = (long long)b * D + d;
        for (int t = 0; t < T; ++t) acc += g[bd * T + t] * (j < K ? padded(x, state, bd, t + j, T, K) : 1.0f);
    }
    if (j < K) d_w[d * K + j] = acc;
    else if (d_bias) d_bias[d] = acc;
}

// Mamba-1's selective scan (same file of kiln.core, selective_scan_ref), u, delta, z [B, D, T], A [D, N],
// B and C [B, N, T] or in G groups [B, G, N, T] (group g serves D / G consecutive channels):
//   dt = softplus(delta + delta_bias) (or without softplus), h_t = exp(dt A) h_{t-1} + (dt B_t) u_t,
//   y_t = <h_t, C_t> + D u_t, out_t = y_t silu(z_t); h_{-1} = ssm_state or 0.
// A warp per channel (b, d), lane n holding state n (N <= 32), sequential over t. Blocks of SCAN_WARPS warps.
__device__ __forceinline__ float softplusf(float x) {
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));  // log(1 + e^x) without overflow, as np.logaddexp(0, x)
}

__device__ __forceinline__ long long bc_index(int b, int d, int n, int t, int D, int N, int T, int G) {
    int g = G ? d / (D / G) : 0;
    return (((long long)b * (G ? G : 1) + g) * N + n) * T + t;
}

__device__ __forceinline__ float step_dt(const float* delta, const float* delta_bias, long long i, int d,
                                         int softplus, float* pre) {
    float x = delta[i] + (delta_bias ? delta_bias[d] : 0.0f);
    *pre = x;
    return softplus ? softplusf(x) : x;
}

extern "C" __global__ void mamba_scan_f32(const float* u, const float* delta, const float* A, const float* Bm,
                                          const float* Cm, const float* Dv, const float* z, const float* delta_bias,
                                          const float* state, float* out, float* last, int Bsz, int D, int T,
                                          int N, int G, int softplus) {
    long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (w >= (long long)Bsz * D) return;  // whole warps leave together
    int b = (int)(w / D), d = (int)(w % D), n = threadIdx.x % 32;
    bool on = n < N;
    float a = on ? A[d * N + n] : 0.0f, h = (on && state) ? state[w * N + n] : 0.0f, pre;
    for (int t = 0; t < T; ++t) {
        long long i = w * T + t;
        float dt = step_dt(delta, delta_bias, i, d, softplus, &pre), uv = u[i];
        float bv = on ? Bm[bc_index(b, d, n, t, D, N, T, G)] : 0.0f, cv = on ? Cm[bc_index(b, d, n, t, D, N, T, G)] : 0.0f;
        h = expf(dt * a) * h + (dt * bv) * uv;
        float y = warp_sum(on ? h * cv : 0.0f);
        if (Dv) y += uv * Dv[d];
        if (z) y *= z[i] * (0.5f * (1.0f + tanhf(0.5f * z[i])));
        if (n == 0) out[i] = y;
    }
    if (last && on) last[w * N + n] = h;
}

// The backward of one channel: the forward replayed (states H [B, D, T, N] and y in scratch), then the scan
// in reverse: d_h_t = g_t C_t + exp(dt_{t+1} A) d_h_{t+1} (+ d_last_state at the end). Per (b, d, t): d_u,
// d_delta (through softplus), d_z; per (b, d, t, n) into scratch: d_B and d_C before their sum over a group's
// channels; per (b, d): the parts of d_A, d_D and d_delta_bias before their sum over the batch (reduce
// kernels below); d_ssm_state[b, d] = what flows into h_{-1}. Gradients are summed over t in reverse.
extern "C" __global__ void mamba_scan_backward_f32(const float* d_out, const float* u, const float* delta,
                                                   const float* A, const float* Bm, const float* Cm, const float* Dv,
                                                   const float* z, const float* delta_bias, const float* state,
                                                   const float* d_last, float* H, float* Y, float* d_u,
                                                   float* d_delta, float* d_z, float* pB, float* pC, float* pA,
                                                   float* pD, float* pDB, float* d_state, int Bsz, int D, int T,
                                                   int N, int G, int softplus) {
    long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (w >= (long long)Bsz * D) return;
    int b = (int)(w / D), d = (int)(w % D), n = threadIdx.x % 32;
    bool on = n < N;
    float a = on ? A[d * N + n] : 0.0f, first = (on && state) ? state[w * N + n] : 0.0f, h = first, pre;
    for (int t = 0; t < T; ++t) {  // the forward, replayed
        long long i = w * T + t;
        float dt = step_dt(delta, delta_bias, i, d, softplus, &pre), uv = u[i];
        float bv = on ? Bm[bc_index(b, d, n, t, D, N, T, G)] : 0.0f, cv = on ? Cm[bc_index(b, d, n, t, D, N, T, G)] : 0.0f;
        h = expf(dt * a) * h + (dt * bv) * uv;
        if (on) H[i * N + n] = h;
        float y = warp_sum(on ? h * cv : 0.0f);
        if (Dv) y += uv * Dv[d];
        if (n == 0) Y[i] = y;
    }
    float acc = (on && d_last) ? d_last[w * N + n] : 0.0f, dA = 0.0f, dD = 0.0f, dDB = 0.0f;
    for (int t = T - 1; t >= 0; --t) {
        long long i = w * T + t;
        float dt = step_dt(delta, delta_bias, i, d, softplus, &pre), uv = u[i], dy = d_out ? d_out[i] : 0.0f;
        float g = dy, dzv = 0.0f;
        if (z) {
            float s = 0.5f * (1.0f + tanhf(0.5f * z[i]));
            g = dy * (z[i] * s);
            dzv = dy * Y[i] * (s * (1.0f + z[i] * (1.0f - s)));
        }
        long long bc = bc_index(b, d, n, t, D, N, T, G);
        float bv = on ? Bm[bc] : 0.0f, cv = on ? Cm[bc] : 0.0f;
        float ht = on ? H[i * N + n] : 0.0f, hp = t > 0 ? (on ? H[(i - 1) * N + n] : 0.0f) : first;
        float decay = expf(dt * a);
        acc += g * cv;
        float d_decay = acc * hp * decay;
        float du = warp_sum(on ? acc * dt * bv : 0.0f) + (Dv ? g * Dv[d] : 0.0f);
        float ddt = warp_sum(on ? acc * bv * uv + d_decay * a : 0.0f);
        float dpre = softplus ? ddt * (0.5f * (1.0f + tanhf(0.5f * pre))) : ddt;
        if (on) {
            pB[i * N + n] = acc * dt * uv;
            pC[i * N + n] = g * ht;
        }
        dA += d_decay * dt;
        dD += g * uv;
        dDB += dpre;
        if (n == 0) {
            d_u[i] = du;
            d_delta[i] = dpre;
            d_z[i] = dzv;
        }
        acc *= decay;
    }
    if (on) pA[w * N + n] = dA;
    if (n == 0) {
        pD[w] = dD;
        pDB[w] = dDB;
    }
    if (d_state && on) d_state[w * N + n] = acc;
}

// out[i] = sum over b (in order) of part[b * n + i]: d_A [D, N], d_D and d_delta_bias [D] from per-batch parts.
extern "C" __global__ void mamba_sum_batch_f32(const float* part, float* out, int Bsz, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        float s = 0.0f;
        for (int b = 0; b < Bsz; ++b) s += part[b * n + i];
        out[i] = s;
    }
}

// d_B (or d_C) [B, G or 1, N, T] from the parts, per channel [B, D, T, N] (the sequential backward's) or with
// `nt` per block of channels [B, D, N, T] (the chunked one's, D there its blocks per batch row): the sum over the
// group's channels (or blocks) in order. A thread per output element.
extern "C" __global__ void mamba_sum_group_f32(const float* part, float* out, int Bsz, int D, int T, int N, int G,
                                               int nt) {
    int groups = G ? G : 1, per = D / groups;
    long long st = nt ? 1 : N, sn = nt ? T : 1;
    long long n_out = (long long)Bsz * groups * N * T;
    for (long long i = first_index(); i < n_out; i += grid_stride()) {
        int t = (int)(i % T), n = (int)(i / T % N), g = (int)(i / ((long long)T * N) % groups);
        int b = (int)(i / ((long long)T * N * groups));
        float s = 0.0f;
        for (int d = g * per; d < (g + 1) * per; ++d) s += part[((long long)b * D + d) * T * N + t * st + n * sn];
        out[i] = s;
    }
}

// --- the chunked scan, for long sequences ---------------------------------------------------------------------
// The plan of Mamba's selective_scan CUDA kernel: a block per channel (b, d), its threads along time, each
// thread holding SCAN_ITEMS consecutive steps, so a chunk is blockDim.x * SCAN_ITEMS steps and a channel's
// chunks run in order inside its block. One step is the affine map h -> a h + b (a = exp(dt A_n),
// b = (dt B_n) u). Per state n (a loop, so N is not bound by a warp), each thread composes its steps' maps, a
// block scan of those gives each thread the map of every step before it in the chunk, applied to the state
// the previous chunk left (in shared memory), and the thread replays its steps from there in the reference's
// order. Only the start of each thread's steps goes through the scan's reassociated products. Steps past T
// are the identity map.
constexpr int SCAN_ITEMS = 8;
constexpr int SCAN_MAX_N = 256;

struct Map {  // h -> a h + b
    float a, b;
};

__device__ __forceinline__ Map then(Map first, Map second) {  // first, then second
    return {second.a * first.a, second.a * first.b + second.b};
}

// The composition of the maps of the threads before this one (identity for the first): in time order, or
// with `reverse` from the last thread down (the backward's scan runs from late to early). A Hillis-Steele
// scan over the lanes of each warp, then over the warps' totals in order: a fixed order, the same bits on
// every run. blockDim.x a multiple of 32; every thread of the block must call it.
__device__ Map scan_maps(Map m, bool reverse) {
    __shared__ float wa[32], wb[32];
    int lane = threadIdx.x % 32, warps = blockDim.x / 32, step = reverse ? -1 : 1;
    int vl = reverse ? 31 - lane : lane, vw = reverse ? warps - 1 - (int)threadIdx.x / 32 : threadIdx.x / 32;
    for (int off = 1; off < 32; off <<= 1) {
        int src = vl >= off ? lane - step * off : lane;
        Map p = {__shfl_sync(FULL_MASK, m.a, src), __shfl_sync(FULL_MASK, m.b, src)};
        if (vl >= off) m = then(p, m);
    }
    int src = vl ? lane - step : lane;
    Map x = {__shfl_sync(FULL_MASK, m.a, src), __shfl_sync(FULL_MASK, m.b, src)};
    if (!vl) x = {1.0f, 0.0f};
    __syncthreads();  // a previous call may still be reading wa, wb
    if (vl == 31) {
        wa[vw] = m.a;
        wb[vw] = m.b;
    }
    __syncthreads();
    Map q = {1.0f, 0.0f};
    for (int k = 0; k < vw; ++k) q = then(q, Map{wa[k], wb[k]});
    return then(q, x);
}

__device__ __forceinline__ float silu_gate(float zv) {
    return zv * (0.5f * (1.0f + tanhf(0.5f * zv)));
}

// The forward (mamba_scan_f32's math): out and last may be null; chunk_states (when not null) receives the
// state at the start of every chunk, [B, D, chunks, N] (the backward's checkpoints). Grid: a block per channel.
extern "C" __global__ void mamba_scan_chunked_f32(const float* u, const float* delta, const float* A,
                                                  const float* Bm, const float* Cm, const float* Dv, const float* z,
                                                  const float* delta_bias, const float* state, float* out,
                                                  float* last, float* chunk_states, int Bsz, int D, int T, int N,
                                                  int G, int softplus) {
    __shared__ float carry[SCAN_MAX_N];
    long long w = blockIdx.x;
    int b = (int)(w / D), d = (int)(w % D), chunk = blockDim.x * SCAN_ITEMS, chunks = (T + chunk - 1) / chunk;
    for (int n = threadIdx.x; n < N; n += blockDim.x) carry[n] = state ? state[w * N + n] : 0.0f;
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
        int t0 = c * chunk + threadIdx.x * SCAN_ITEMS;
        float uv[SCAN_ITEMS], dt[SCAN_ITEMS], y[SCAN_ITEMS], pre;
#pragma unroll
        for (int i = 0; i < SCAN_ITEMS; ++i) {
            bool on = t0 + i < T;
            uv[i] = on ? u[w * T + t0 + i] : 0.0f;
            dt[i] = on ? step_dt(delta, delta_bias, w * T + t0 + i, d, softplus, &pre) : 0.0f;
            y[i] = 0.0f;
        }
        for (int n = 0; n < N; ++n) {
            float a = A[d * N + n];
            Map m[SCAN_ITEMS], agg = {1.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < SCAN_ITEMS; ++i) {
                m[i] = t0 + i < T ? Map{expf(dt[i] * a), (dt[i] * Bm[bc_index(b, d, n, t0 + i, D, N, T, G)]) * uv[i]}
                                  : Map{1.0f, 0.0f};
                agg = then(agg, m[i]);
            }
            Map before = scan_maps(agg, false);
            float h0 = carry[n];
            if (chunk_states && threadIdx.x == 0) chunk_states[(w * chunks + c) * N + n] = h0;
            float h = before.a * h0 + before.b;
#pragma unroll
            for (int i = 0; i < SCAN_ITEMS; ++i) {
                h = m[i].a * h + m[i].b;
                if (out && t0 + i < T) y[i] += h * Cm[bc_index(b, d, n, t0 + i, D, N, T, G)];
            }
            __syncthreads();  // every thread has read carry[n]
            if (threadIdx.x == blockDim.x - 1) carry[n] = h;  // the chunk's last state
        }
        if (out) {
#pragma unroll
            for (int i = 0; i < SCAN_ITEMS; ++i) {
                if (t0 + i >= T) continue;
                long long k = w * T + t0 + i;
                float yv = Dv ? y[i] + uv[i] * Dv[d] : y[i];
                out[k] = z ? yv * silu_gate(z[k]) : yv;
            }
        }
    }
    __syncthreads();
    if (last)
        for (int n = threadIdx.x; n < N; n += blockDim.x) last[w * N + n] = carry[n];
}

// The backward (mamba_scan_backward_f32's math), chunk by chunk from the last: per chunk and state n, the
// states replayed from the chunk's checkpoint (chunk_states, by mamba_scan_chunked_f32 with the same block
// size), then the reverse scan d_h_t = g_t C_t + exp(dt_{t+1} A) d_h_{t+1} as maps acc -> decay (acc + g C)
// scanned from the last thread down, the carry d_h flowing to the chunk before in shared memory. Per step:
// d_u, d_delta, d_z; per (b, d, n, t) into scratch, [B, D, N, T]: the parts of d_B and d_C before their sum
// over a group's channels; per (b, d): d_A's part summed per thread in reverse time, over the block, then over
// the chunks from the last; d_D's and d_delta_bias's per thread, then over the block.
// A block runs `per_block` consecutive channels of one group, one after another, and sums their parts of d_B and
// d_C in its own slice of pB and pC, [B * D / per_block, N, T], in channel order: each (n, t) belongs to one
// thread, which adds the channels' parts in order (no atomics, the same bits on every run). With per_block the
// group's size, the slices are d_B and d_C themselves ([B, G, N, T]); else mamba_sum_group_f32 sums the slices.
extern "C" __global__ void mamba_scan_chunked_backward_f32(const float* d_out, const float* u, const float* delta,
                                                           const float* A, const float* Bm, const float* Cm,
                                                           const float* Dv, const float* z, const float* delta_bias,
                                                           const float* chunk_states, const float* d_last,
                                                           float* d_u, float* d_delta, float* d_z, float* pB,
                                                           float* pC, float* pA, float* pD, float* pDB,
                                                           float* d_state, int Bsz, int D, int T, int N, int G,
                                                           int softplus, int per_block) {
    __shared__ float dcarry[SCAN_MAX_N], dA_sum[SCAN_MAX_N];
    long long slot = blockIdx.x;
    int chunk = blockDim.x * SCAN_ITEMS, chunks = (T + chunk - 1) / chunk;
    for (int j = 0; j < per_block; ++j) {
        long long w = slot * per_block + j;
        int b = (int)(w / D), d = (int)(w % D);
        for (int n = threadIdx.x; n < N; n += blockDim.x) {  // the thread that read them for the channel before
            dcarry[n] = d_last ? d_last[w * N + n] : 0.0f;
            dA_sum[n] = 0.0f;
        }
        __syncthreads();
        float dD = 0.0f, dDB = 0.0f, pre;
        for (int c = chunks - 1; c >= 0; --c) {
            int t0 = c * chunk + threadIdx.x * SCAN_ITEMS;
            float uv[SCAN_ITEMS], dt[SCAN_ITEMS], g[SCAN_ITEMS], y[SCAN_ITEMS], du[SCAN_ITEMS], ddt[SCAN_ITEMS];
#pragma unroll
            for (int i = 0; i < SCAN_ITEMS; ++i) {
                bool on = t0 + i < T;
                long long k = w * T + t0 + i;
                uv[i] = on ? u[k] : 0.0f;
                dt[i] = on ? step_dt(delta, delta_bias, k, d, softplus, &pre) : 0.0f;
                float dy = on && d_out ? d_out[k] : 0.0f;
                g[i] = on && z ? dy * silu_gate(z[k]) : dy;
                du[i] = Dv ? g[i] * Dv[d] : 0.0f;
                y[i] = ddt[i] = 0.0f;
            }
            for (int n = 0; n < N; ++n) {
                float a = A[d * N + n], decay[SCAN_ITEMS], bv[SCAN_ITEMS], cv[SCAN_ITEMS], h[SCAN_ITEMS];
                Map agg = {1.0f, 0.0f};
#pragma unroll
                for (int i = 0; i < SCAN_ITEMS; ++i) {
                    bool on = t0 + i < T;
                    bv[i] = on ? Bm[bc_index(b, d, n, t0 + i, D, N, T, G)] : 0.0f;
                    cv[i] = on ? Cm[bc_index(b, d, n, t0 + i, D, N, T, G)] : 0.0f;
                    decay[i] = on ? expf(dt[i] * a) : 1.0f;
                    agg = then(agg, Map{decay[i], (dt[i] * bv[i]) * uv[i]});
                }
                Map before = scan_maps(agg, false);
                float h0 = chunk_states[(w * chunks + c) * N + n];
                float first = before.a * h0 + before.b, hh = first;
#pragma unroll
                for (int i = 0; i < SCAN_ITEMS; ++i) {
                    hh = decay[i] * hh + (dt[i] * bv[i]) * uv[i];
                    h[i] = hh;
                }
                Map ragg = {1.0f, 0.0f};
#pragma unroll
                for (int i = SCAN_ITEMS - 1; i >= 0; --i) ragg = then(ragg, Map{decay[i], decay[i] * (g[i] * cv[i])});
                Map later = scan_maps(ragg, true);
                float acc = later.a * dcarry[n] + later.b, dAt = 0.0f;
#pragma unroll
                for (int i = SCAN_ITEMS - 1; i >= 0; --i) {
                    if (t0 + i >= T) continue;
                    acc += g[i] * cv[i];  // d_h at this step
                    float hp = i ? h[i - 1] : first, d_decay = acc * hp * decay[i];
                    du[i] += acc * dt[i] * bv[i];
                    ddt[i] += acc * bv[i] * uv[i] + d_decay * a;
                    dAt += d_decay * dt[i];
                    y[i] += h[i] * cv[i];
                    long long k = (slot * N + n) * T + t0 + i;
                    float vb = acc * dt[i] * uv[i], vc = g[i] * h[i];
                    pB[k] = j ? pB[k] + vb : vb;
                    pC[k] = j ? pC[k] + vc : vc;
                    acc *= decay[i];
                }
                float dA = block_sum(dAt);  // its barriers: every thread has read dcarry[n]
                if (threadIdx.x == 0) {
                    dcarry[n] = acc;  // what flows into the chunk before
                    dA_sum[n] += dA;
                }
            }
#pragma unroll
            for (int i = 0; i < SCAN_ITEMS; ++i) {
                if (t0 + i >= T) continue;
                long long k = w * T + t0 + i;
                float dpre = ddt[i];
                step_dt(delta, delta_bias, k, d, softplus, &pre);
                if (softplus) dpre *= 0.5f * (1.0f + tanhf(0.5f * pre));
                float dzv = 0.0f;
                if (z) {
                    float s = 0.5f * (1.0f + tanhf(0.5f * z[k])), yv = Dv ? y[i] + uv[i] * Dv[d] : y[i];
                    dzv = (d_out ? d_out[k] : 0.0f) * yv * (s * (1.0f + z[k] * (1.0f - s)));
                }
                d_u[k] = du[i];
                d_delta[k] = dpre;
                d_z[k] = dzv;
                dD += g[i] * uv[i];
                dDB += dpre;
            }
        }
        float sD = block_sum(dD), sDB = block_sum(dDB);  // their barriers: thread 0's last writes are done
        if (threadIdx.x == 0) {
            pD[w] = sD;
            pDB[w] = sDB;
        }
        for (int n = threadIdx.x; n < N; n += blockDim.x) {
            pA[w * N + n] = dA_sum[n];
            if (d_state) d_state[w * N + n] = dcarry[n];
        }
    }
}
