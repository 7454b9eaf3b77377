/* Trains the program of the spec in argv[1] for argv[2] steps through libkiln, in host memory:
 * prints the version, then one loss per line (%a: exact), then writes argv[3]'s tensor to argv[4]. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static int check(int status, const char *what)
{
    if (status != KILN_OK) {
        char error[4096];
        kiln_last_error(error, sizeof error, NULL);
        fprintf(stderr, "%s: status %d: %s\n", what, status, error);
        exit(1);
    }
    return status;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: train SPEC_JSON STEPS TENSOR OUT\n");
        return 2;
    }
    char version[1024];
    check(kiln_version(version, sizeof version, NULL), "kiln_version");
    printf("%s\n", version);

    kiln_program program;
    check(kiln_compile(argv[1], &program), "kiln_compile");
    size_t plan_size, arena_size;
    check(kiln_plan(program, NULL, 0, &plan_size), "kiln_plan");
    check(kiln_arena_bytes(program, &arena_size), "kiln_arena_bytes");
    void *arena = aligned_alloc(64, (arena_size + 63) / 64 * 64);
    check(kiln_bind(program, arena, arena_size), "kiln_bind");

    /* the batch of step s: token (b * 7 + t * 3 + s) % 64, labels the next token */
    enum { B = 2, T = 8 };
    int32_t ids[B * T], labels[B * T];
    for (int s = 0; s < atoi(argv[2]); s++) {
        for (int i = 0; i < B * T; i++) {
            ids[i] = ((i / T) * 7 + (i % T) * 3 + s) % 64;
            labels[i] = ((i / T) * 7 + (i % T + 1) * 3 + s) % 64;
        }
        kiln_step_stats stats;
        check(kiln_train_step(program, ids, labels, B * T, &stats), "kiln_train_step");
        printf("%a %lld\n", stats.loss, (long long)stats.step);
    }

    /* a tensor, read through the ABI, and compared with the bound memory at its planned offset */
    size_t nbytes = 0;
    char *plan = malloc(plan_size);
    check(kiln_plan(program, plan, plan_size, NULL), "kiln_plan");
    char key[512];
    snprintf(key, sizeof key, "\"%s\": {", argv[3]);
    const char *entry = strstr(strstr(plan, "\"tensors\""), key);
    size_t offset = strtoull(strstr(entry, "\"offset\": ") + 10, NULL, 10);
    nbytes = strtoull(strstr(entry, "\"nbytes\": ") + 10, NULL, 10);
    void *copy = malloc(nbytes);
    check(kiln_get_tensor(program, argv[3], copy, nbytes), "kiln_get_tensor");
    if (memcmp(copy, (char *)arena + offset, nbytes) != 0) {
        fprintf(stderr, "kiln_get_tensor differs from the bound arena at offset %zu\n", offset);
        return 1;
    }
    FILE *out = fopen(argv[4], "wb");
    fwrite(copy, 1, nbytes, out);
    fclose(out);
    check(kiln_free(program), "kiln_free");
    free(copy);
    free(plan);
    free(arena);
    return 0;
}
