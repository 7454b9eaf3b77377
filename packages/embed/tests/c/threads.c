/* Two threads, each training its own program (argv[1]) for three steps at the same time, after one
 * of them made an error: prints "thread status loss loss loss" and each thread's last error code. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

typedef struct {
    const char *spec;
    int bad, status;
    double losses[3];
    char error[512];
} job;

static void *train(void *arg)
{
    job *j = arg;
    kiln_program program;
    char dst[4];
    if (j->bad)
        kiln_get_tensor(999, "embedding", dst, sizeof dst); /* this thread's last error only */
    size_t nbytes;
    if ((j->status = kiln_compile(j->spec, &program)) || (j->status = kiln_arena_bytes(program, &nbytes)))
        return NULL;
    void *arena = aligned_alloc(64, (nbytes + 63) / 64 * 64);
    if ((j->status = kiln_bind(program, arena, nbytes)))
        return NULL;
    int32_t ids[16], labels[16];
    for (int i = 0; i < 16; i++) {
        ids[i] = i % 64;
        labels[i] = (i + 1) % 64;
    }
    for (int s = 0; s < 3; s++) {
        kiln_step_stats stats;
        if ((j->status = kiln_train_step(program, ids, labels, 16, &stats)))
            return NULL;
        j->losses[s] = stats.loss;
    }
    j->status = kiln_free(program);
    kiln_last_error(j->error, sizeof j->error, NULL);
    free(arena);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    job jobs[2] = {{.spec = argv[1], .bad = 1}, {.spec = argv[1], .bad = 0}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, train, &jobs[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    for (int i = 0; i < 2; i++)
        printf("%d %d %a %a %a |%s\n", i, jobs[i].status, jobs[i].losses[0], jobs[i].losses[1], jobs[i].losses[2],
               jobs[i].error);
    return 0;
}
