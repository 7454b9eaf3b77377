// The rotary angle of pair k at a position, shared by rope.cu and attention.cu: from a freqs table
// [MaxSeq, half, 2] (cos, sin) when given, else angle = pos * theta^(-2k / rotary_dim) as HF computes it.
#pragma once

__device__ __forceinline__ void rope_cos_sin(const float* freqs, int pos, int k, int half, int rotary_dim,
                                             float theta, float* c, float* s) {
    if (freqs) {
        *c = freqs[((long long)pos * half + k) * 2];
        *s = freqs[((long long)pos * half + k) * 2 + 1];
    } else {
        float inv_freq = 1.0f / powf(theta, (float)(2 * k) / (float)rotary_dim);
        float angle = (float)pos * inv_freq;
        *c = cosf(angle);
        *s = sinf(angle);
    }
}
