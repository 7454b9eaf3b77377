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

// The partner of dim d (< 2 half) in its rotary pair, and the pair's index k: pairs are (k, k + half), or
// (2k, 2k + 1) when interleaved (GPT-J's layout); *first says whether d is the pair's first member.
__device__ __forceinline__ int rope_partner(int d, int half, int interleaved, int* k, bool* first) {
    if (interleaved) {
        *k = d / 2;
        *first = d % 2 == 0;
        return *first ? d + 1 : d - 1;
    }
    *first = d < half;
    *k = *first ? d : d - half;
    return *first ? d + half : d - half;
}
