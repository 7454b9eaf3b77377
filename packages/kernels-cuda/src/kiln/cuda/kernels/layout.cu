// Layout ops (kiln.core ops/library/_tensor.py and broadcast_to of _elementwise.py): transpose, permute, concat,
// split and broadcast_to are each one or more strided copies. kiln.cuda._ops.strided_copy describes a copy as
// six dims (leading dims of size 1, adjacent dims contiguous on both sides merged; the first dim's size is
// implied by n) with a stride per dim on each side: a broadcast dim reads with stride 0, a concat input writes
// into its slice of the output, a split part reads its slice of the input. 32-bit elements (float32 and int32
// alike: the bits are copied); a thread per element in a grid-stride loop in the copy's order (ew_grid).
#include "common.cuh"

extern "C" __global__ void strided_copy_b32(const unsigned* src, unsigned* dst, long long n,
                                            long long n1, long long n2, long long n3, long long n4, long long n5,
                                            long long s0, long long s1, long long s2, long long s3,
                                            long long s4, long long s5, long long t0, long long t1, long long t2,
                                            long long t3, long long t4, long long t5) {
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
