// Mixture-of-experts routing (kiln.core ops/library/_moe.py): sigmoid scores, top-k, the permutation of
// token rows to expert-grouped rows and back, and grouped GEMMs (SIMT, one thread per output element).
// Rows of x_perm are the N k (token, slot) pairs grouped by expert; scatter_idx[r] = token k + slot of
// row r; offsets[e]:offsets[e + 1] are expert e's rows. Every sum runs in a fixed order, no atomics.
#include "common.cuh"

// moe_sigmoid: p = 1 / (1 + exp(-x)) in the overflow-free form 0.5 (1 + tanh(x / 2)); and its backward
// d_x = d p (1 - p). Elementwise geometry.
extern "C" __global__ void moe_sigmoid_f32(const float* x, float* p, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) p[i] = 0.5f * (1.0f + tanhf(0.5f * x[i]));
}

extern "C" __global__ void moe_sigmoid_backward_f32(const float* d, const float* p, float* dx, long long n) {
    for (long long i = first_index(); i < n; i += grid_stride()) dx[i] = d[i] * p[i] * (1.0f - p[i]);
}

// moe_topk: per row the k largest of E probs, largest first, ties to the lower expert index (the order
// of (-p, e)); slot s takes the smallest (-p, e) after slot s - 1's. normalize divides by their sum.
// One thread per row: grid cdiv(N, 256), 256 threads.
extern "C" __global__ void moe_topk_f32(const float* probs, float* weights, int* indices, int N, int E, int k,
                                        int normalize) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float* p = probs + (long long)n * E;
    float prev = INFINITY, total = 0.0f;
    int prev_e = -1;
    for (int s = 0; s < k; ++s) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
            bool after = p[e] < prev || (p[e] == prev && e > prev_e);  // comes after the previous slot
            if (after && (best < 0 || p[e] > p[best])) best = e;
        }
        prev = p[best];
        prev_e = best;
        weights[(long long)n * k + s] = prev;
        indices[(long long)n * k + s] = best;
        total += prev;
    }
    if (normalize)
        for (int s = 0; s < k; ++s) weights[(long long)n * k + s] /= total;
}

// moe_topk_backward: d_probs = zeros, d_weights scattered to the chosen experts (through w = s / sum(s)
// when normalize: ds_j = (dw_j - <dw, s> / sum(s)) / sum(s)). One thread per row.
extern "C" __global__ void moe_topk_backward_f32(const float* d, const float* probs, const int* indices,
                                                 float* d_probs, int N, int E, int k, int normalize) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float* dn = d + (long long)n * k;
    const int* idx = indices + (long long)n * k;
    float total = 0.0f, dot = 0.0f;
    for (int s = 0; s < k; ++s) {
        float w = probs[(long long)n * E + idx[s]];
        total += w;
        dot += dn[s] * w;
    }
    for (int e = 0; e < E; ++e) d_probs[(long long)n * E + e] = 0.0f;
    for (int s = 0; s < k; ++s)
        d_probs[(long long)n * E + idx[s]] = normalize ? (dn[s] - dot / total) / total : dn[s];
}

// moe_permute, the routing: offsets from the counts of each expert, and scatter_idx: expert e's rows take
// the positions p = token k + slot with indices[p] == e in increasing p (a stable sort by expert). A
// thread per expert scans all R = N k positions; indices outside 0..E-1 are in no expert. One block of
// 256 threads.
extern "C" __global__ void moe_route_f32(const int* indices, int* scatter_idx, int* offsets, int R, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int count = 0;
        for (int p = 0; p < R; ++p) count += indices[p] == e;
        offsets[e + 1] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int r = offsets[e];
        for (int p = 0; p < R; ++p)
            if (indices[p] == e) scatter_idx[r++] = p;
    }
}

// moe_permute, the rows: x_perm[r] = x[scatter_idx[r] / k]; elementwise over R x C.
extern "C" __global__ void moe_gather_rows_f32(const float* x, const int* scatter_idx, float* x_perm, long long R,
                                               int C, int k) {
    for (long long i = first_index(); i < R * C; i += grid_stride()) {
        long long r = i / C;
        x_perm[i] = x[(long long)(scatter_idx[r] / k) * C + i % C];
    }
}

// The inverse permutation: row_of[scatter_idx[r]] = r. Elementwise over R.
extern "C" __global__ void moe_invert_f32(const int* scatter_idx, int* row_of, long long R) {
    for (long long r = first_index(); r < R; r += grid_stride()) row_of[scatter_idx[r]] = (int)r;
}

// moe_permute_backward (weights null) and moe_unpermute: out[t] = sum over slots j (in order) of
// w[t, j] y[row_of[t k + j]] (w = 1 when null). Elementwise over N x C.
extern "C" __global__ void moe_combine_rows_f32(const float* y, const float* weights, const int* row_of,
                                                float* out, long long N, int C, int k) {
    for (long long i = first_index(); i < N * C; i += grid_stride()) {
        long long t = i / C;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            float w = weights ? weights[t * k + j] : 1.0f;
            acc += w * y[(long long)row_of[t * k + j] * C + i % C];
        }
        out[i] = acc;
    }
}

// moe_unpermute_dy: d_y[r] = weights.flat[s] d_out[s / k], s = scatter_idx[r]. Elementwise over R x C.
extern "C" __global__ void moe_unpermute_dy_f32(const float* d, const float* weights, const int* scatter_idx,
                                                float* d_y, long long R, int C, int k) {
    for (long long i = first_index(); i < R * C; i += grid_stride()) {
        int s = scatter_idx[i / C];
        d_y[i] = weights[s] * d[(long long)(s / k) * C + i % C];
    }
}

// moe_unpermute_dw: d_weights.flat[s] = <d_out[s / k], y[r]>, s = scatter_idx[r] (positions no row names
// stay 0: the launch zeroes d_weights first). A warp per row: grid R, 32 threads.
extern "C" __global__ void moe_unpermute_dw_f32(const float* d, const float* y, const int* scatter_idx,
                                                float* d_weights, int C, int k) {
    long long r = blockIdx.x;
    int s = scatter_idx[r];
    float acc = 0.0f;
    for (int c = threadIdx.x; c < C; c += 32) acc += d[(long long)(s / k) * C + c] * y[r * C + c];
    acc = warp_sum(acc);
    if (threadIdx.x == 0) d_weights[s] = acc;
}

// The expert of row r: the e with offsets[e] <= r < offsets[e + 1] (binary search; the last such e).
__device__ __forceinline__ int expert_of(const int* offsets, int E, long long r) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// grouped_gemm, moe_grouped_gemm_gate_up / _down (nt = 1: w [E, O, I]) and moe_grouped_gemm_dx, grouped_gemm
// NN (nt = 0: w [E, I, O]): out[r, o] = sum_i x[r, i] w_e[o, i] (or w_e[i, o]) for row r of expert e.
// Grid (cdiv(O, 16), cdiv(R, 16)), 16 x 16 threads.
extern "C" __global__ void grouped_gemm_f32(const float* x, const float* w, const int* offsets, float* out, int R,
                                            int E, int O, int I, int nt) {
    int o = blockIdx.x * 16 + threadIdx.x, r = blockIdx.y * 16 + threadIdx.y;
    if (r >= R || o >= O) return;
    const float* we = w + (long long)expert_of(offsets, E, r) * O * I;
    const float* xr = x + (long long)r * I;
    float acc = 0.0f;
    for (int i = 0; i < I; ++i) acc += xr[i] * (nt ? we[(long long)o * I + i] : we[(long long)i * O + o]);
    out[(long long)r * O + o] = acc;
}

// moe_grouped_gemm_dw: dw[e, o, i] = sum over expert e's rows r (in order) of d[r, o] x[r, i] (0 for an
// empty expert). Grid (cdiv(I, 16), cdiv(O, 16), E), 16 x 16 threads.
extern "C" __global__ void grouped_gemm_dw_f32(const float* d, const float* x, const int* offsets, float* dw,
                                               int O, int I) {
    int i = blockIdx.x * 16 + threadIdx.x, o = blockIdx.y * 16 + threadIdx.y, e = blockIdx.z;
    if (o >= O || i >= I) return;
    float acc = 0.0f;
    for (int r = offsets[e]; r < offsets[e + 1]; ++r) acc += d[(long long)r * O + o] * x[(long long)r * I + i];
    dw[((long long)e * O + o) * I + i] = acc;
}

// moe_load_stats (kiln.core ops/library/_router.py): per expert e (one block each), over the rows that
// count (segment_ids != 0 when given): load[e] = assignments of e among the top-k indices [N, K] / rows,
// mean_probs[e] = sum of probs[n, e] / rows; rows at least 1. Block sums in a fixed order.
extern "C" __global__ void moe_load_stats_f32(const float* probs, const int* indices, const int* segment_ids,
                                              float* load, float* mean_probs, int N, int E, int K) {
    int e = blockIdx.x;
    float rows = 0.0f, count = 0.0f, sum = 0.0f;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        if (segment_ids && segment_ids[n] == 0) continue;
        rows += 1.0f;
        sum += probs[(long long)n * E + e];
        for (int j = 0; j < K; ++j) count += indices[(long long)n * K + j] == e ? 1.0f : 0.0f;
    }
    rows = fmaxf(block_sum(rows), 1.0f);
    count = block_sum(count);
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
        load[e] = count / rows;
        mean_probs[e] = sum / rows;
    }
}

// moe_load_stats_backward: d_probs[n, e] = d_mean_probs[e] / rows on the rows that count, else 0. One block
// counts the rows, then grid-strides over N x E.
extern "C" __global__ void moe_load_stats_backward_f32(const float* d_mean, const int* segment_ids, float* d_probs,
                                                       int N, int E) {
    float rows = 0.0f;
    for (int n = threadIdx.x; n < N; n += blockDim.x) rows += (segment_ids && segment_ids[n] == 0) ? 0.0f : 1.0f;
    rows = fmaxf(block_sum(rows), 1.0f);
    for (long long i = threadIdx.x; i < (long long)N * E; i += blockDim.x) {
        int n = (int)(i / E);
        d_probs[i] = (segment_ids && segment_ids[n] == 0) ? 0.0f : d_mean[i % E] / rows;
    }
}

// moe_aux_loss: aux = E * sum_e load[e] * mean_probs[e] / L^2 (one block, a fixed-order sum);
// loss_out[i] = loss[i] + (coef * aux) on every token whose target is not ignore_index. loss_out may be
// loss's own storage.
extern "C" __global__ void moe_aux_loss_f32(const float* loss, const int* targets, const float* load,
                                            const float* mean_probs, float* loss_out, float* aux_out, int N,
                                            int E, float coef, int layers, int ignore_index) {
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) s += load[e] * mean_probs[e];
    float aux = (float)E * block_sum(s) / ((float)layers * (float)layers);
    float add = coef * aux;
    for (int i = threadIdx.x; i < N; i += blockDim.x) loss_out[i] = targets[i] != ignore_index ? loss[i] + add : loss[i];
    if (threadIdx.x == 0) *aux_out = aux;
}

// moe_aux_loss_backward: d_mean_probs[e] = (coef * sum of d_loss_out over counted tokens + d_aux) * E * load[e]
// / L^2; d_loss_out and d_aux may be null. One block.
extern "C" __global__ void moe_aux_loss_backward_f32(const float* d_loss, const float* d_aux, const int* targets,
                                                     const float* load, float* d_mean, int N, int E, float coef,
                                                     int layers, int ignore_index) {
    float s = 0.0f;
    if (d_loss)
        for (int i = threadIdx.x; i < N; i += blockDim.x) s += targets[i] != ignore_index ? d_loss[i] : 0.0f;
    float total = coef * block_sum(s) + (d_aux ? *d_aux : 0.0f);
    float f = total * (float)E / ((float)layers * (float)layers);
    for (int e = threadIdx.x; e < E; e += blockDim.x) d_mean[e] = f * load[e];
}

// moe_router (kiln.core ops/library/_router.py) is a composition: the matmul x @ gate^T, the softmax (or
// moe_sigmoid) kernel, moe_topk_f32 and moe_load_stats_f32 over all N rows (load[e] = count_e / N,
// mean_probs[e] = mean_n probs[n, e]); then its load-balancing loss, transformers' E sum_e (count_e / N)
// mean_n probs[n, e] times the coefficient: aux = coef E sum_e load[e] mean_probs[e]. One block, the
// experts summed in a fixed order.
extern "C" __global__ void moe_router_aux_f32(const float* load, const float* mean_probs, float* aux, int E,
                                              float coef) {
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) s += load[e] * mean_probs[e];
    s = block_sum(s);
    if (threadIdx.x == 0) *aux = coef * (float)E * s;
}

// moe_router_backward, the loss's share: d aux / d probs[n, e] = coef E count_e / N^2, so
// d_probs[n, e] += d_aux coef E load[e] / N (load[e] = count_e / N). Elementwise over N x E.
extern "C" __global__ void moe_router_aux_backward_f32(const float* d_aux, const float* load, float* d_probs,
                                                       long long N, int E, float coef) {
    float f = *d_aux * coef * (float)E / (float)N;
    for (long long i = first_index(); i < N * E; i += grid_stride()) d_probs[i] += f * load[i % E];
}
