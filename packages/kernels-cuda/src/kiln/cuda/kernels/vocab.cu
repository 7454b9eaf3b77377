// Token ids (or targets) mapped into one rank's rows of a vocabulary split over ranks (kiln-dist's
// vocabulary parallelism: kiln.dist._vocab _local, and the kernels' uses of it in kiln.dist._cuda). Rank
// `rank` holds rows [rank * rows, (rank + 1) * rows); ids are int32.
#include "common.cuh"

// For each id: its owner, the rank whose rows hold it (-1 for an ignored id, or one outside [0, size));
// rel = id - rank * rows where this rank owns it, -1 for an ignored id, else `fill`; mine = 1 where this
// rank owns it, else 0. Each output may be null. An id (not `ignore`) outside [0, size) is an error a
// kernel cannot raise: it stores 1 and the id in err[0], err[1] (whole-word stores: one of several such
// ids), which the host reads where it already synchronises (kiln.cuda._ops check_id_errors). An `ignore`
// outside int32 ignores nothing. One thread per id, grid-stride (ew_grid over N).
extern "C" __global__ void vocab_local_ids_i32(const int* ids, int* rel, int* mine, int* owner, long long* err,
                                               long long N, int rows, int rank, int size, int fill,
                                               long long ignore) {
    for (long long i = first_index(); i < N; i += grid_stride()) {
        int id = ids[i];
        bool live = id != ignore, known = id >= 0 && id < size;
        if (live && !known && err) {
            err[1] = id;
            err[0] = 1;
        }
        int o = live && known ? id / rows : -1;
        if (rel) rel[i] = o == rank ? id - rank * rows : (live ? fill : -1);
        if (mine) mine[i] = o == rank;
        if (owner) owner[i] = o;
    }
}
