// Cross-entropy over logits [N, V] (kiln.core ops/library/_loss.py cross_entropy, cross_entropy_backward):
// one block of 256 threads per row, grid = N. A target equal to ignore_index has loss and gradient 0; a
// target outside [0, V) gives a NaN loss (the reference raises; a kernel cannot). The LM head's fused
// training pass (below) runs both on one tile of logits.
#include "bf16.cuh"  // and common.cuh

// loss = lse - logits[target], lse = max + log(sum(exp(logits - max)))
extern "C" __global__ void cross_entropy_f32(const float* logits, const int* targets, float* loss, float* lse,
                                             int V, int ignore_index) {
    long long row = blockIdx.x;
    const float* z = logits + row * V;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, z[c]);
    m = block_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) s += expf(z[c] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        float l = m + logf(s);
        int t = targets[row];
        lse[row] = l;
        loss[row] = t == ignore_index ? 0.0f : (t >= 0 && t < V ? l - z[t] : NAN);
    }
}

// d_logits = exp(logits - lse) * (dl + dlse) - onehot(target) * dl, dl = d_loss (0 where ignored),
// dlse = d_lse; d_loss and d_lse may be null. d_logits may be logits' own storage.
extern "C" __global__ void cross_entropy_backward_f32(const float* d_loss, const float* logits, const int* targets,
                                                      const float* lse, const float* d_lse, float* d_logits,
                                                      int V, int ignore_index) {
    long long row = blockIdx.x;
    int t = targets[row];
    float dl = (d_loss && t != ignore_index) ? d_loss[row] : 0.0f;
    float dlse = d_lse ? d_lse[row] : 0.0f, l = lse[row];
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        long long i = row * V + c;
        d_logits[i] = expf(logits[i] - l) * (dl + dlse) - (c == t ? dl : 0.0f);
    }
}

// The LM head's loss and its logits' gradient in one pass over a tile of logits [rows, V] (kiln.core
// ops/library/_loss.py fused_lm_head_loss_and_grad: a training step knows d_loss before its forward runs):
// cross_entropy_f32 and cross_entropy_backward_f32 without d_lse, the same sums in the same order, so the
// same bits. One block per row, grid = rows. z holds the logits on entry and their gradient
// (softmax - onehot(target)) * d_loss on exit; d_loss may be null (a zero gradient).
extern "C" __global__ void lm_head_loss_grad_f32(const float* d_loss, float* z, const int* targets, float* loss,
                                                 float* lse, int V, int ignore_index) {
    long long row = blockIdx.x;
    float* zr = z + row * V;
    int t = targets[row];
    bool valid = t >= 0 && t < V;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, zr[c]);
    m = block_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) s += expf(zr[c] - m);
    float zt = threadIdx.x == 0 && valid ? zr[t] : 0.0f;  // read before block_sum's barriers: no write yet
    s = block_sum(s);
    float l = m + logf(s);
    if (threadIdx.x == 0) {
        lse[row] = l;
        loss[row] = t == ignore_index ? 0.0f : (valid ? l - zt : NAN);
    }
    float dl = (d_loss && t != ignore_index) ? d_loss[row] : 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) zr[c] = expf(zr[c] - l) * dl - (c == t ? dl : 0.0f);
}

// The same under the bf16 recipe (fused_lm_head_loss_bf16 then its backward in kiln.cuda._ops): the logits
// z (float32 products of bf16 operands) read rounded to bf16, the loss and log-sum-exp in float32, and the
// gradient rounded to bf16 into g (the gradient of a bf16 tensor): the rounding points of the two steps.
extern "C" __global__ void lm_head_loss_grad_bf16(const float* d_loss, const float* z, const int* targets,
                                                  float* loss, float* lse, bf16* g, int V, int ignore_index) {
    long long row = blockIdx.x;
    const float* zr = z + row * V;
    bf16* gr = g + row * V;
    int t = targets[row];
    bool valid = t >= 0 && t < V;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, round_bf16(zr[c]));
    m = block_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x) s += expf(round_bf16(zr[c]) - m);
    s = block_sum(s);
    float l = m + logf(s);
    if (threadIdx.x == 0) {
        lse[row] = l;
        loss[row] = t == ignore_index ? 0.0f : (valid ? l - round_bf16(zr[t]) : NAN);
    }
    float dl = (d_loss && t != ignore_index) ? d_loss[row] : 0.0f;
    for (int c = threadIdx.x; c < V; c += blockDim.x)
        gr[c] = f32_to_bf16(expf(round_bf16(zr[c]) - l) * dl - (c == t ? dl : 0.0f));
}

// The LM head's pass tiled over the vocabulary too (kiln.cuda._ops._vocab_tiled_pass): a row block's logits
// come a chunk [v0, v0 + Vc) at a time, z [rows, Vc]. Pass 1 runs lm_head_lse_chunk on every chunk (the
// online log-sum-exp: a running maximum m and sum s of exp(z - m), rescaled as the maximum grows, and the
// target's logit zt where the target lies in the chunk; first: the row's first chunk), then lm_head_lse_done
// once; pass 2 recomputes each chunk and turns it into its gradient with lm_head_grad_chunk. The bf16
// twins read the logits rounded to bf16 and write the gradient as bf16: lm_head_loss_grad_bf16's rounding
// points. One block per row, grid = rows.
template <bool BF16>
__device__ void lse_chunk(const float* z, const int* targets, float* m, float* s, float* zt, int Vc, int v0,
                          int first) {
    long long row = blockIdx.x;
    const float* zr = z + row * Vc;
    float mc = -INFINITY;
    for (int c = threadIdx.x; c < Vc; c += blockDim.x) mc = fmaxf(mc, BF16 ? round_bf16(zr[c]) : zr[c]);
    mc = block_max(mc);
    float mo = first ? -INFINITY : m[row];  // every thread reads before block_sum's barriers; thread 0 writes after
    float mn = fmaxf(mo, mc), sc = 0.0f;
    if (mn != -INFINITY)
        for (int c = threadIdx.x; c < Vc; c += blockDim.x) sc += expf((BF16 ? round_bf16(zr[c]) : zr[c]) - mn);
    sc = block_sum(sc);
    if (threadIdx.x == 0) {
        float so = first || mo == -INFINITY ? 0.0f : s[row] * expf(mo - mn);
        m[row] = mn;
        s[row] = so + sc;
        int t = targets[row] - v0;
        if (t >= 0 && t < Vc) zt[row] = BF16 ? round_bf16(zr[t]) : zr[t];
    }
}

extern "C" __global__ void lm_head_lse_chunk_f32(const float* z, const int* targets, float* m, float* s,
                                                 float* zt, int Vc, int v0, int first) {
    lse_chunk<false>(z, targets, m, s, zt, Vc, v0, first);
}

extern "C" __global__ void lm_head_lse_chunk_bf16(const float* z, const int* targets, float* m, float* s,
                                                  float* zt, int Vc, int v0, int first) {
    lse_chunk<true>(z, targets, m, s, zt, Vc, v0, first);
}

// After the last chunk, per row (elementwise over rows): lse = m + log(s), loss = lse - zt (0 where ignored,
// NaN for a target outside [0, V)). lse holds m on entry; zt may be loss's own storage.
extern "C" __global__ void lm_head_lse_done_f32(const float* s, const float* zt, const int* targets, float* loss,
                                                float* lse, int rows, int V, int ignore_index) {
    for (long long i = first_index(); i < rows; i += grid_stride()) {
        float l = lse[i] + logf(s[i]), z = zt[i];
        int t = targets[i];
        lse[i] = l;
        loss[i] = t == ignore_index ? 0.0f : (t >= 0 && t < V ? l - z : NAN);
    }
}

// Pass 2 on a chunk: its gradient (softmax - onehot(target)) * d_loss, in place of z (f32) or into g (bf16).
extern "C" __global__ void lm_head_grad_chunk_f32(const float* d_loss, float* z, const int* targets,
                                                  const float* lse, int Vc, int v0, int ignore_index) {
    long long row = blockIdx.x;
    float* zr = z + row * Vc;
    int t = targets[row] - v0;
    float dl = (d_loss && targets[row] != ignore_index) ? d_loss[row] : 0.0f, l = lse[row];
    for (int c = threadIdx.x; c < Vc; c += blockDim.x) zr[c] = expf(zr[c] - l) * dl - (c == t ? dl : 0.0f);
}

extern "C" __global__ void lm_head_grad_chunk_bf16(const float* d_loss, const float* z, const int* targets,
                                                   const float* lse, bf16* g, int Vc, int v0, int ignore_index) {
    long long row = blockIdx.x;
    const float* zr = z + row * Vc;
    bf16* gr = g + row * Vc;
    int t = targets[row] - v0;
    float dl = (d_loss && targets[row] != ignore_index) ? d_loss[row] : 0.0f, l = lse[row];
    for (int c = threadIdx.x; c < Vc; c += blockDim.x)
        gr[c] = f32_to_bf16(expf(round_bf16(zr[c]) - l) * dl - (c == t ? dl : 0.0f));
}
