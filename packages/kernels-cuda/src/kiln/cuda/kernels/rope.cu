// Rotary position embedding (kiln.core ops/library/_attention.py rope): x is [B, T, H * D]; the first
// rotary_dim dims of each head rotate in pairs (j, j + half), half = rotary_dim / 2:
// [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin] (sin negated for the inverse); the rest is copied.
// interleaved: the pairs are (2j, 2j + 1) instead (GPT-J).
// cos and sin come from freqs [MaxSeq, half, 2] when given, else angle = pos * theta^(-2j / rotary_dim).
// One thread per (b, t, h, k), k < half rotating a pair and k >= half copying dim rotary_dim + k - half:
// grid-stride over B * T * H * (D - half). out may be x's own storage.
#include "common.cuh"
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
