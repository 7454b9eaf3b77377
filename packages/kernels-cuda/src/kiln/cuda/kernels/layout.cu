// Layout ops (kiln.core ops/library/_tensor.py and broadcast_to of _elementwise.py): transpose, permute, concat,
// split and broadcast_to are each one or more strided copies. kiln.cuda._ops.strided_copy describes a copy as
// six dims (leading dims of size 1, adjacent dims contiguous on both sides merged; the first dim's size is
// implied by n) with a stride per dim on each side: a broadcast dim reads with stride 0, a concat input writes
// into its slice of the output, a split part reads its slice of the input. The bits are copied: 32-bit elements
// (float32 and int32 alike) by strided_copy_b32, 16-bit ones (bf16 tensors of the bf16 recipe, never widened) by
// strided_copy_b16; a thread per element in a grid-stride loop in the copy's order (ew_grid).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void strided_copy(const T* src, T* dst, long long n, long long n1, long long n2,
                                             long long n3, long long n4, long long n5, long long s0, long long s1,
                                             long long s2, long long s3, long long s4, long long s5, long long t0,
                                             long long t1, long long t2, long long t3, long long t4, long long t5) {
    for (long long i = first_index(); i < n; i += grid_stride()) {
        long long r = i, from = 0, to = 0, k;
        k = r % n5; r /= n5; from += k * s5; to += k * t5;
        k = r % n4; r /= n4; from += k * s4; to += k * t4;
        k = r % n3; r /= n3; from += k * s3; to += k * t3;
        k = r % n2; r /= n2; from += k * s2; to += k * t2;
        k = r % n1; r /= n1; from += k * s1; to += k * t1;
        from += r * s0; to += r * t0;
        dst[to] = src[from];
    }
}

extern "C" __global__ void strided_copy_b32(const unsigned* src, unsigned* dst, long long n,
                                            long long n1, long long n2, long long n3, long long n4, long long n5,
                                            long long s0, long long s1, long long s2, long long s3,
                                            long long s4, long long s5, long long t0, long long t1, long long t2,
                                            long long t3, long long t4, long long t5) {
    strided_copy(src, dst, n, n1, n2, n3, n4, n5, s0, s1, s2, s3, s4, s5, t0, t1, t2, t3, t4, t5);
}

extern "C" __global__ void strided_copy_b16(const unsigned short* src, unsigned short* dst, long long n,
                                            long long n1, long long n2, long long n3, long long n4, long long n5,
                                            long long s0, long long s1, long long s2, long long s3,
                                            long long s4, long long s5, long long t0, long long t1, long long t2,
                                            long long t3, long long t4, long long t5) {
    strided_copy(src, dst, n, n1, n2, n3, n4, n5, s0, s1, s2, s3, s4, s5, t0, t1, t2, t3, t4, t5);
}

// The copy whose innermost output dim runs across the source's rows: per batch z, src [R, C] (rows ls apart) to
// dst [C, R] (rows ld apart), the last-two-axes swap of transpose (or a permute ending in one). The classic tiled
// transpose: a block of TILE x TILE_ROWS threads reads a TILE x TILE tile along the source's rows (coalesced)
// into shared memory, then writes it along the destination's rows (coalesced); a row of TILE + 1 elements keeps a
// warp's column reads of the tile on distinct banks. Grid: (cdiv(C, TILE), cdiv(R, TILE), batch), y and z at most
// 65535 (the blocks loop over the rest); ragged edges masked.
constexpr int TILE = 32, TILE_ROWS = 8;

template <typename T>
__device__ __forceinline__ void transpose_tiled(const T* src, T* dst, long long batch, long long R, long long C,
                                                long long ls, long long ld, long long sz, long long tz) {
    __shared__ T tile[TILE][TILE + 1];
    long long c0 = (long long)blockIdx.x * TILE;
    for (long long z = blockIdx.z; z < batch; z += gridDim.z) {
        for (long long r0 = (long long)blockIdx.y * TILE; r0 < R; r0 += (long long)gridDim.y * TILE) {
            for (int j = threadIdx.y; j < TILE; j += TILE_ROWS) {
                long long r = r0 + j, c = c0 + threadIdx.x;
                if (r < R && c < C) tile[j][threadIdx.x] = src[z * sz + r * ls + c];
            }
            __syncthreads();
            for (int j = threadIdx.y; j < TILE; j += TILE_ROWS) {
                long long c = c0 + j, r = r0 + threadIdx.x;
                if (r < R && c < C) dst[z * tz + c * ld + r] = tile[threadIdx.x][j];
            }
            __syncthreads();  // the tile is read before the next one overwrites it
        }
    }
}

extern "C" __global__ void transpose_tiled_b32(const unsigned* src, unsigned* dst, long long batch, long long R,
                                               long long C, long long ls, long long ld, long long sz,
                                               long long tz) {
    transpose_tiled(src, dst, batch, R, C, ls, ld, sz, tz);
}

extern "C" __global__ void transpose_tiled_b16(const unsigned short* src, unsigned short* dst, long long batch,
                                               long long R, long long C, long long ls, long long ld, long long sz,
                                               long long tz) {
    transpose_tiled(src, dst, batch, R, C, ls, ld, sz, tz);
}
