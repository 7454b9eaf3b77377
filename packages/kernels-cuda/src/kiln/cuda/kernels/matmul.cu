// Matrix products (kiln.core ops/library/_linalg.py matmul, batched_matmul): a SIMT tiled kernel, the
// portable first version (cuBLASLt through nvmath-python is the fast path). matmul_bf16 is the same kernel on
// bf16 A and B (the bf16 precision recipe): each product of two bf16 values is exact in fp32, summed in fp32.
// out[b] = alpha * op(A[b]) op(B[b]) + beta * acc[b]; op(A) is [M, K] (A stored [M, K], or [K, M] when
// trans_a), op(B) is [K, N] (B stored [K, N], or [N, K] when trans_b); acc may be null or out itself.
// The bf16 recipe's variants matmul_bf16_<a><b><out> (h: a bf16 tensor, f: a float32 one) read each operand
// as its slot holds it, a float32 operand rounded to bf16 on its load into shared memory (the recipe's
// rounding of a matmul's inputs, with no bf16 copy of the operand), and store out as bf16 (rounded to
// nearest even, store_f32: no float32 temporary) or float32; acc is float32. matmul_bf16 is _hhf.
// Geometry: TILE x TILE threads per block, grid (cdiv(N, TILE), cdiv(M, TILE), batch); each block stages a
// TILE x TILE tile of op(A) and op(B) in shared memory per step of K.
#include "common.cuh"
#include "bf16.cuh"

constexpr int TILE = 16;

// An operand: a bf16 element widened (exact), a float32 one as it is or, under the bf16 recipe (RND), rounded.
template <bool RND> __device__ __forceinline__ float load_op(float x) { return RND ? round_bf16(x) : x; }
template <bool RND> __device__ __forceinline__ float load_op(bf16 x) { return bf16_to_f32(x); }

template <bool RND, typename TA, typename TB, typename TO>
__device__ __forceinline__ void matmul_tile(const TA* A, const TB* B, const float* acc, TO* out, int M, int N,
                                            int K, int trans_a, int trans_b, long long stride_a, long long stride_b,
                                            long long stride_out, float alpha, float beta) {
    __shared__ float As[TILE][TILE + 1];
    __shared__ float Bs[TILE][TILE + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    A += blockIdx.z * stride_a;
    B += blockIdx.z * stride_b;
    out += blockIdx.z * stride_out;
    if (acc) acc += blockIdx.z * stride_out;
    float sum = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        int ka = k0 + tx, kb = k0 + ty;
        As[ty][tx] = (row < M && ka < K)
                         ? load_op<RND>(trans_a ? A[(long long)ka * M + row] : A[(long long)row * K + ka]) : 0.0f;
        Bs[ty][tx] = (kb < K && col < N)
                         ? load_op<RND>(trans_b ? B[(long long)col * K + kb] : B[(long long)kb * N + col]) : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) sum += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) {
        long long i = (long long)row * N + col;
        float r = alpha * sum;
        if (acc) r += beta * acc[i];
        store_f32(out, i, r);
    }
}

extern "C" __global__ void matmul_f32(const float* A, const float* B, const float* acc, float* out, int M, int N,
                                      int K, int trans_a, int trans_b, long long stride_a, long long stride_b,
                                      long long stride_out, float alpha, float beta) {
    matmul_tile<false>(A, B, acc, out, M, N, K, trans_a, trans_b, stride_a, stride_b, stride_out, alpha, beta);
}

extern "C" __global__ void matmul_bf16(const bf16* A, const bf16* B, const float* acc, float* out, int M, int N,
                                       int K, int trans_a, int trans_b, long long stride_a, long long stride_b,
                                       long long stride_out, float alpha, float beta) {
    matmul_tile<true>(A, B, acc, out, M, N, K, trans_a, trans_b, stride_a, stride_b, stride_out, alpha, beta);
}

// The variants' parameters (matmul_bf16's with a's, b's and out's types) and their body.
#define MATMUL_PARAMS(TA, TB, TO)                                                                                \
    const TA *A, const TB *B, const float *acc, TO *out, int M, int N, int K, int trans_a, int trans_b,          \
        long long stride_a, long long stride_b, long long stride_out, float alpha, float beta
#define MATMUL_BODY                                                                                              \
    { matmul_tile<true>(A, B, acc, out, M, N, K, trans_a, trans_b, stride_a, stride_b, stride_out, alpha, beta); }

extern "C" __global__ void matmul_bf16_hhh(MATMUL_PARAMS(bf16, bf16, bf16)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_hff(MATMUL_PARAMS(bf16, float, float)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_hfh(MATMUL_PARAMS(bf16, float, bf16)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_fhf(MATMUL_PARAMS(float, bf16, float)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_fhh(MATMUL_PARAMS(float, bf16, bf16)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_fff(MATMUL_PARAMS(float, float, float)) MATMUL_BODY
extern "C" __global__ void matmul_bf16_ffh(MATMUL_PARAMS(float, float, bf16)) MATMUL_BODY
