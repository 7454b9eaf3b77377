// Cross-entropy over logits [N, V] (kiln.core ops/library/_loss.py cross_entropy, cross_entropy_backward):
// one block of 256 threads per row, grid = N. A target equal to ignore_index has loss and gradient 0; a
// target outside [0, V) gives a NaN loss (the reference raises; a kernel cannot).
#include "common.cuh"

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
